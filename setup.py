"""Packages: `retrain*`, plus the top-level conf/ tree shipped inside the wheel as `retrain.conf` and the
docs/ pages as `retrain.manual` (what `retrain man` shows)."""

from pathlib import Path

from setuptools import find_packages, setup

CONF = Path("conf")
conf_dirs = [CONF, *sorted(p for p in CONF.rglob("*") if p.is_dir() and p.name != "__pycache__")]
conf_packages = {".".join(("retrain", *d.parts)): d.as_posix() for d in conf_dirs}
data_packages = {**conf_packages, "retrain.manual": "docs"}

setup(
    packages=find_packages(include=["retrain", "retrain.*"]) + list(data_packages),
    package_dir=data_packages,
    package_data={
        **{name: ["*.yaml"] for name in conf_packages},
        "retrain.manual": ["*.md", "*.yaml"],  # default-config.yaml: a generated page `retrain man --check` reads
        "retrain.templates": ["*/*.yaml", "*/*.py.tmpl"],
        "retrain.assets": ["*/*.json", "*/*.safetensors", "*/*.md", "*/*.jinja", "*/*.txt"],
    },
)
