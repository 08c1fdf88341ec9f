"""`retrain plugins [--config-dir DIR ...] [--json]`: every part you can pick, built in or your own.

Lists each config group's built-in options (conf/ and the named conditions) and the options found
in your config dirs (every `--config-dir`, and ./conf when it exists), each with the `_target_`s it
builds: its own and those of what its defaults list pulls in. Read statically, so nothing is
imported and nothing is composed. A user option named like a built-in one of its group is flagged:
Hydra finds retrain's own first, so yours would never be used.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from retrain.config import config_dir, config_groups, register_configs

DEFAULT_USER_DIR = Path("conf")


@dataclass(frozen=True)
class Part:
    """One option of a config group and the `_target_`s it builds."""

    group: str
    option: str
    targets: tuple[str, ...]
    path: str  # its YAML file, or "<generated>" for a ConfigStore entry
    shadowed: bool = False  # a user option that a built-in one of the same name hides

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "option": self.option, "targets": list(self.targets), "path": self.path} | (
            {"shadowed_by_builtin": True} if self.shadowed else {}
        )


class SearchPath:
    """Where options are found, in Hydra's order: retrain's conf/, then the user's dirs, then the ConfigStore."""

    def __init__(self, roots: list[Path]) -> None:
        register_configs()
        self.roots = roots
        self.store = ConfigStore.instance()

    def load(self, group: str, option: str) -> tuple[dict[str, Any], str] | None:
        """The option's content as a plain dict and where it came from; None when no root has it."""
        for root in self.roots:
            path = root / group / f"{option}.yaml"
            if path.is_file():
                return _read_yaml(path), str(path)
        try:
            node = self.store.load(f"{group}/{option}.yaml" if group else f"{option}.yaml").node
        except OSError:
            return None
        content = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
        return ({str(k): v for k, v in content.items()} if isinstance(content, dict) else {}), "<generated>"

    def targets(self, group: str, content: dict[str, Any]) -> list[str]:
        """The `_target_`s the option builds: those of what its defaults list selects, overridden key by
        key by its own (`_self_` last, as retrain's options all have it)."""
        return list(dict.fromkeys(self._targets_by_key(group, content, "", frozenset()).values()))

    def _targets_by_key(self, group: str, content: dict[str, Any], prefix: str, seen: frozenset[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for sub_group, option, at in _defaults(group, content.get("defaults", [])):
            key = f"{sub_group}/{option}"
            loaded = None if key in seen else self.load(sub_group, option)
            if loaded is not None:
                found |= self._targets_by_key(sub_group, loaded[0], _join(prefix, at), seen | {key})
        return found | _own_targets({k: v for k, v in content.items() if k != "defaults"}, prefix)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        return {"_error_": f"not valid YAML: {error}"}
    return content if isinstance(content, dict) else {}


def _defaults(group: str, entries: Any) -> Iterator[tuple[str, str, str]]:
    """(group, option, key it lands at) of each entry of a defaults list, as Hydra resolves it from an
    option of `group`: `{advantage: maxrl}` is algorithm/advantage/maxrl at `advantage`,
    `{override /model: tiny}` is model/tiny at `model`, a plain name is an option of the same group."""
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, str) and entry != "_self_":
            yield group, entry.removeprefix("optional "), ""
        elif isinstance(entry, dict):
            for key, value in entry.items():
                key = str(key).removeprefix("override ").removeprefix("optional ").strip().split("@")[0]
                sub_group = key[1:] if key.startswith("/") else f"{group}/{key}" if group else key
                at = key.lstrip("/").replace("/", ".")
                for option in value if isinstance(value, list) else [value]:
                    if isinstance(option, str):
                        yield sub_group, option, at


def _join(prefix: str, key: str) -> str:
    return ".".join(part for part in (prefix, key) if part)


def _own_targets(node: Any, prefix: str) -> dict[str, str]:
    """`_target_` values below `node` by their dotted key."""
    if isinstance(node, dict):
        own = {prefix: str(node["_target_"])} if "_target_" in node else {}
        return own | {
            key: target
            for name, value in node.items()
            if name != "_target_"
            for key, target in _own_targets(value, _join(prefix, str(name))).items()
        }
    if isinstance(node, list):
        return {
            key: target
            for i, value in enumerate(node)
            for key, target in _own_targets(value, _join(prefix, str(i))).items()
        }
    return {}


def builtin_parts() -> list[Part]:
    search = SearchPath([Path(config_dir())])
    parts = []
    for group, options in config_groups().items():
        for option in options:
            loaded = search.load(group, option)
            if loaded is not None:
                parts.append(Part(group, option, tuple(search.targets(group, loaded[0])), loaded[1]))
    return parts


def user_parts(root: Path, builtin: dict[str, list[str]]) -> list[Part]:
    """Every `<group>/<option>.yaml` below `root`, its targets resolved against it and retrain's conf/."""
    search = SearchPath([Path(config_dir()), root])
    parts = []
    for path in sorted(root.rglob("*.yaml")):
        group = path.parent.relative_to(root).as_posix()
        if group == ".":  # a primary config, not an option
            continue
        content = _read_yaml(path)
        targets = [f"<{content['_error_']}>"] if "_error_" in content else search.targets(group, content)
        parts.append(Part(group, path.stem, tuple(targets), str(path), path.stem in builtin.get(group, [])))
    return sorted(parts, key=lambda part: (part.group, part.option))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrain plugins", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config-dir", action="append", default=[], type=Path, help="a config dir of yours (repeatable; ./conf always)"
    )
    parser.add_argument("--json", action="store_true", help="print the machine-readable listing")
    args = parser.parse_args(argv)
    for missing in [d for d in args.config_dir if not d.is_dir()]:
        parser.exit(1, f"retrain plugins: --config-dir {missing} is not a directory\n")
    user_dirs = _user_dirs(args.config_dir)
    builtin = builtin_parts()
    groups = config_groups()
    users = {str(root): user_parts(root, groups) for root in user_dirs}
    if args.json:
        listing = {
            "builtin": [p.as_dict() for p in builtin],
            "user": {d: [p.as_dict() for p in ps] for d, ps in users.items()},
        }
        print(json.dumps(listing, indent=2))
        return 0
    print(f"Built-in parts ({config_dir()}):")
    _print_parts(builtin)
    for root, parts in users.items():
        print(f"\nYour parts ({root}; run with --config-dir {root}):")
        _print_parts(parts) if parts else print("  (no options: put them in <group>/<name>.yaml)")
    if not users:
        print("\nNo config dir of yours (./conf or --config-dir): `retrain init-plugin` scaffolds one.")
    return 0


def _user_dirs(given: list[Path]) -> list[Path]:
    """The given dirs and ./conf, each once, without retrain's own conf/ (a checkout run from its root)."""
    own = Path(config_dir()).resolve()
    candidates = [*given, *([DEFAULT_USER_DIR] if DEFAULT_USER_DIR.is_dir() else [])]
    unique = {d.resolve(): d for d in reversed(candidates)}
    return [d for resolved, d in reversed(unique.items()) if resolved != own]


def _print_parts(parts: list[Part]) -> None:
    """Grouped; the targets every option of a group shares (the schema's, the pipeline's) are said once."""
    width = max(len(p.option) for p in parts)
    for group in dict.fromkeys(p.group for p in parts):
        members = [p for p in parts if p.group == group]
        shared = [t for t in members[0].targets if all(t in p.targets for p in members)] if len(members) > 1 else []
        print(f"  {group}:" + (f"  (every option: {', '.join(shared)})" if shared else ""))
        for part in members:
            targets = [t for t in part.targets if t not in shared]
            flag = "  [hidden by the built-in option of this name: rename it]" if part.shadowed else ""
            print(f"    {part.option:<{width}}  {', '.join(targets) or '-'}{flag}".rstrip())
