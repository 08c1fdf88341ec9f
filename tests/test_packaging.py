"""retrain installs as a wheel into a fresh virtual environment, conf/ and the tiny model inside it."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_built_wheel_runs_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(REPO)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    wheel = next((tmp_path / "dist").glob("retrain-*.whl"))
    venv.EnvBuilder(with_pip=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    see_dependencies_of_this_interpreter(python)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()

    where = subprocess.run(
        [str(python), "-c", "import retrain, retrain.config as c; print(retrain.__file__); print(c.config_dir())"],
        check=True,
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
    ).stdout.split()
    assert str(tmp_path / "venv") in where[0] and str(tmp_path / "venv") in where[1], where

    run_dir = workdir / "run"
    demo = subprocess.run(
        [
            str(tmp_path / "venv" / "bin" / "retrain"),
            "experiment=quickstart",
            "training.max_steps=2",
            "eval.num_examples=0",
            "logging.progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert (run_dir / "final" / "adapter_model.safetensors").is_file()
    module = subprocess.run(
        [str(python), "-m", "retrain", "--cfg", "job", "experiment=quickstart"],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
    )
    assert module.returncode == 0 and "ArithmeticData" in module.stdout
    retrain = str(tmp_path / "venv" / "bin" / "retrain")
    manual = subprocess.run([retrain, "man", "--list-topics"], capture_output=True, text=True, cwd=workdir, env=env)
    assert manual.returncode == 0 and manual.stdout.split() == sorted(p.stem for p in (REPO / "docs").glob("*.md"))
    check = subprocess.run([retrain, "man", "--check"], capture_output=True, text=True, cwd=workdir, env=env)
    assert check.returncode == 0, check.stderr  # the wheel's manual holds every generated page, current
    scaffold = [retrain, "init-plugin", "--kind", "reward", "--name", "my_reward", "--with-test"]
    assert subprocess.run(scaffold, capture_output=True, cwd=workdir, env=env).returncode == 0  # templates shipped
    assert (workdir / "conf" / "reward" / "my_reward.yaml").is_file() and (workdir / "test_my_reward.py").is_file()


def see_dependencies_of_this_interpreter(python: Path) -> None:
    """Let the venv import what this interpreter's site dirs hold, listed after its own site-packages.

    Whether the suite runs from a system Python or from inside a virtualenv, the dependencies are
    where this interpreter finds them (`system_site_packages` would reach the base interpreter's
    instead). Plain path lines: the .pth files there (an editable install of retrain) stay inert, so
    retrain itself comes only from the wheel.
    """
    site_dirs = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(own, "dependencies_of_the_test_runner.pth").write_text(
        "".join(f"{d}\n" for d in site_dirs if Path(d).is_dir())
    )
