"""`retrain migrate-config old.toml`: a TOML config of the original retrain becomes a Hydra preset.

A training TOML becomes `DIR/experiment/<stem>.yaml` (run: `python -m retrain --config-dir DIR
experiment=<stem>`), a campaign TOML (one with `[campaign]`) `DIR/campaign/<stem>.yaml` (run:
`python -m retrain --config-dir DIR --multirun +campaign=<stem>`). The preset is composed before it is
written, so a written preset always composes. `--check` exits 1 for a TOML, which retrain no longer
reads (CI: no config left unmigrated), and 0 for a YAML preset.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from retrain.errors import ConfigError

if TYPE_CHECKING:
    from retrain.migrate.preset import Preset

MAX_DEPTH = 32  # nesting of arrays and tables migrate-config reads
PRESET_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a Hydra option name usable as `experiment=<name>`


def check_depth(toml: dict[str, Any]) -> None:
    """ConfigError naming the key where arrays or tables nest deeper than MAX_DEPTH (a seeds config nests 3 deep),
    before the translation and Hydra's composition walk them recursively."""
    stack: list[tuple[Any, str, int]] = [(toml, "", 0)]
    while stack:
        node, key, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{key} nests arrays or tables deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            stack += [(child, f"{key}.{name}" if key else str(name), depth + 1) for name, child in node.items()]
        elif isinstance(node, list):
            stack += [(child, f"{key}[{index}]", depth + 1) for index, child in enumerate(node)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrain migrate-config", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="old.toml", help="TOML config(s) in the original format")
    parser.add_argument("--output-dir", default="conf", help="config dir to write into (default: ./conf)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file still needs migrating")
    parser.add_argument("--stdout", action="store_true", help="print the preset instead of writing it")
    parser.add_argument("--force", action="store_true", help="overwrite a different preset of the same name")
    args = parser.parse_args(argv)
    status = 0
    for path in args.paths:
        try:
            status = max(status, _one(path, args))
        except ConfigError as error:
            print(f"retrain migrate-config: {path}: {error}", file=sys.stderr)
            status = 1
    return status


def _one(path: Path, args: argparse.Namespace) -> int:
    if path.suffix in (".yaml", ".yml"):
        if args.check:
            print(f"{path}: a YAML config, nothing to migrate")
            return 0
        raise ConfigError("already a YAML config; give a .toml file in the original format")
    from retrain.migrate.translate import translate

    if not PRESET_NAME.match(path.stem):
        raise ConfigError(f"{path.stem!r} cannot name a preset (letters, digits, _ . -); rename the file")
    if path.exists() and not path.is_file() and not path.is_dir():  # reading a FIFO or a device may never end
        raise ConfigError("not a regular file (a FIFO, socket or device); give a .toml file")
    try:
        toml = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"not a readable TOML file ({error})") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError("not a readable TOML file (arrays or tables nested too deep to parse)") from None
    check_depth(toml)
    preset = translate(toml, path.name)
    text = preset.render(args.output_dir, path.stem)
    _check_composes(text, preset.package, path.stem)
    target = Path(args.output_dir) / preset.package / f"{path.stem}.yaml"
    current = target.read_text(encoding="utf-8") if target.is_file() else None
    if args.check:
        state = "missing" if current is None else ("up to date" if current == text else "out of date")
        print(f"{path}: needs migrating (retrain reads no TOML); its preset {target} is {state}")
        return 1
    if args.stdout:
        sys.stdout.write(text)
        _report(preset, target, args.output_dir, path.stem, out=sys.stderr)
        return 0
    if current is not None and current != text and not args.force:
        raise ConfigError(f"{target} exists and differs from this migration; use --force to overwrite it")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    _report(preset, target, args.output_dir, path.stem, out=sys.stdout)
    return 0


def _check_composes(text: str, package: str, name: str) -> None:
    """Compose the preset as `--config-dir` would, from a scratch dir: Hydra's own error if it cannot."""
    from retrain.config import compose

    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / package).mkdir()
        (Path(scratch) / package / f"{name}.yaml").write_text(text, encoding="utf-8")
        choice = f"+campaign={name}" if package == "campaign" else f"experiment={name}"
        try:
            compose([f"hydra.searchpath=['file://{scratch}']", choice], return_hydra_config=True)
        except Exception as error:  # Hydra's composition errors have no common base; each names the key
            raise ConfigError(f"the migrated preset does not compose in this retrain: {error}") from None


def _report(preset: Preset, target: Path, config_dir: str, name: str, out: TextIO) -> None:
    print(f"wrote {target}" if out is sys.stdout else f"# would write {target}", file=out)
    print(f"run it: {preset.command(config_dir, name)}", file=out)
    if preset.dropped:
        print("not carried over (retrain handles these differently):", file=out)
        for item in preset.dropped:
            print(f"  {item.line()}", file=out)
    for note in preset.notes:
        print(f"note: {note}", file=out)
