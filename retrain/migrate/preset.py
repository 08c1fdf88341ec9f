"""A Hydra preset being built from a TOML of the original format: group choices, values, and what was left out.

Every TOML key the migration reads ends up in exactly one place: a group choice (`backend=tinker`),
a value at a dotted key (`training.lr`), or a `Dropped` entry with the reason retrain needs no
such setting. `render` writes all three into the preset, the dropped keys as comments, so nothing
is lost silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import yaml

# the order of the composed config (`python -m retrain --cfg job`), then Hydra's own node
SECTION_ORDER = (
    "backend",
    "model",
    "algorithm",
    "inference",
    "reward",
    "data",
    "training",
    "scoring",
    "backpressure",
    "logging",
    "eval",
    "resume",
    "squeeze",
    "hydra",
)


@dataclass(frozen=True)
class Dropped:
    """A TOML key with no place in the preset, and why retrain needs none."""

    key: str  # as the TOML spells it: "[backend] adapter_path"
    value: Any
    reason: str

    def line(self) -> str:
        return f"{self.key} = {_toml_literal(self.value)}: {self.reason}"


@dataclass
class Preset:
    """What a migrated preset holds; `set` and `choose` refuse to write one key twice."""

    source: str  # the TOML file's name, for the header
    package: str  # "experiment" or "campaign": the config group the preset is an option of
    # group -> option, e.g. "algorithm" -> "grpo_none"; None removes the group's option (an untyped node follows)
    choices: dict[str, str | None] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)  # nested, as the preset's body
    dropped: list[Dropped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # behaviour that differs although a key maps

    def choose(self, group: str, option: str) -> None:
        if self.choices.get(group, option) != option:
            raise ValueError(f"{group} chosen twice: {self.choices[group]!r} and {option!r}")
        self.choices[group] = option

    def set(self, dotted: str, value: Any) -> None:
        """Set the value at a dotted key (`algorithm.sepa.steps`), creating the nodes above it."""
        *parents, leaf = dotted.split(".")
        node = self.values
        for part in parents:
            node = node.setdefault(part, {})
        if leaf in node and node[leaf] != value:
            raise ValueError(f"{dotted} set twice: {node[leaf]!r} and {value!r}")
        node[leaf] = value

    def get(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.values
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def drop(self, key: str, value: Any, reason: str) -> None:
        self.dropped.append(Dropped(key, value, reason))

    def command(self, config_dir: str, name: str) -> str:
        """The command line that runs this preset."""
        if self.package == "campaign":
            return f"python -m retrain --config-dir {config_dir} --multirun +campaign={name}"
        return f"python -m retrain --config-dir {config_dir} experiment={name}"

    def render(self, config_dir: str, name: str) -> str:
        """The preset as YAML: header, defaults list, body in the composed config's order."""
        header = [
            "# @package _global_",
            f"# Migrated by `retrain migrate-config` from {self.source} (the original TOML format).",
            f"#   {self.command(config_dir, name)}",
        ]
        if self.dropped:
            header.append("# TOML keys with no setting here (retrain handles them differently):")
            header += [f"#   {item.line()}" for item in self.dropped]
        if self.notes:
            header.append("# Behaviour that differs from the original retrain:")
            header += [f"#   {note}" for note in self.notes]
        body: dict[str, Any] = {}
        if self.choices:
            body["defaults"] = [{f"override /{group}": option} for group, option in self.choices.items()]
        order = {section: index for index, section in enumerate(SECTION_ORDER)}
        for section in sorted(self.values, key=lambda key: order.get(key, len(order))):
            body[section] = self.values[section]
        text = yaml.safe_dump(body, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)
        return "\n".join(header) + "\n" + text


def _toml_literal(value: Any) -> str:
    """A value as the TOML file wrote it, for the dropped-keys comments."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml_literal(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(item) for item in value) + "]"
    return repr(value)
