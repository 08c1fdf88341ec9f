"""`retrain init-plugin --kind advantage|transform|uncertainty|reward|backend --name X [--with-test] [--dir D]`.

Scaffolds a working plugin of that kind in your project: the module `D/X.py` (the kind's contract, with
a simple implementation to replace), its YAML option in your config dir `D/conf/<group>/X.yaml`, and
with `--with-test` a pytest file `D/test_X.py` that passes as written (`python -m pytest test_X.py`).
Then it prints the command that runs retrain with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from retrain.config import config_groups


@dataclass(frozen=True)
class Kind:
    """Where a kind's YAML option goes, what its `_target_` is and how a run selects it."""

    group: str
    is_class: bool  # the target is a class named in CamelCase (else a function named like the module)
    override: str  # the command-line selection, with {name}

    def target(self, name: str) -> str:
        return f"{name}.{camel(name) if self.is_class else name}"


KINDS: dict[str, Kind] = {
    "advantage": Kind("algorithm/advantage", False, "algorithm/advantage={name}"),
    "transform": Kind("algorithm/transforms", True, "algorithm/transforms=[sepa,gtpo,{name}]"),
    "uncertainty": Kind("algorithm", False, "algorithm={name}"),
    "reward": Kind("reward", False, "reward={name}"),
    "backend": Kind("backend", True, "backend={name}"),
}
CONFIG_DIR = "conf"


def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part) or name


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrain init-plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", required=True, choices=list(KINDS), help="what the plugin is")
    parser.add_argument("--name", required=True, help="its module name (a Python identifier), also its option's name")
    parser.add_argument("--with-test", action="store_true", help="also write test_<name>.py")
    parser.add_argument("--dir", default=".", type=Path, help="your project dir (default: the current one)")
    parser.add_argument("--force", action="store_true", help="overwrite files of those names")
    args = parser.parse_args(argv)
    name, kind = args.name, KINDS[args.kind]
    if not name.isascii() or not name.isidentifier() or keyword.iskeyword(name) or not name.islower():
        parser.error(
            f"--name {name!r} must be a lower-case ASCII Python identifier (it is the module's name, and "
            "Hydra's command line reads no other letters)"
        )
    if (origin := existing_module(name, args.dir)) is not None:
        parser.exit(
            1,
            f"retrain init-plugin: --name {name} would shadow the module {name} ({origin}) that a run may import; "
            "pick another --name\n",
        )
    if name in config_groups().get(kind.group, []):
        parser.exit(
            1, f"retrain init-plugin: {kind.group}={name} is built in and would win over yours; pick another --name\n"
        )
    files = scaffold(args.kind, name, args.dir, args.with_test)
    existing = [path for path in files if path.exists()]
    if existing and not args.force:
        parser.exit(1, f"retrain init-plugin: {', '.join(map(str, existing))} exist(s); pass --force to overwrite\n")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    where = "" if args.dir == Path(".") else f"cd {args.dir} && "
    print(f"run with it (from {args.dir}):\n  {where}{command(args.kind, name)}")
    if args.with_test:
        print(f"test it:\n  {where}python -m pytest test_{name}.py")
    return 0


def existing_module(name: str, project: Path) -> str | None:
    """Where a module called `name` already comes from (the standard library, an installed package), or None.

    The project's dir goes first on a run's sys.path, so a plugin module of that name would replace it
    (`--name retrain` would replace retrain itself). A module file already in `project` is the plugin's own.
    """
    if name in sys.builtin_module_names or name in sys.stdlib_module_names:
        return "the standard library"
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), name)
    if Path(origin).parent.resolve() == project.resolve():
        return None
    return origin


def command(kind: str, name: str) -> str:
    return f"python -m retrain --config-dir {CONFIG_DIR} '{KINDS[kind].override.format(name=name)}'"


def scaffold(kind: str, name: str, project: Path, with_test: bool) -> dict[Path, str]:
    """The files of a `kind` plugin called `name` in `project`, by path."""
    spec = KINDS[kind]
    slots = {
        "name": name,
        "cls": camel(name),
        "target": spec.target(name),
        "config_dir": CONFIG_DIR,
        "override": spec.override.format(name=name),
        "command": command(kind, name),
    }
    files = {
        project / f"{name}.py": _render(f"{kind}.py.tmpl", slots),
        project / CONFIG_DIR / spec.group / f"{name}.yaml": _render(f"{kind}.yaml", slots),
    }
    if with_test:
        files[project / f"test_{name}.py"] = _render(f"test_{kind}.py.tmpl", slots)
    return files


def _render(template: str, slots: dict[str, str]) -> str:
    text = resources.files("retrain.templates").joinpath("plugins", template).read_text(encoding="utf-8")
    return Template(text).substitute(slots)
