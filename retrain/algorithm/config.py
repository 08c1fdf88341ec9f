"""Typed schema of the `algorithm` config group, its named conditions, and how a composed algorithm is named.

An algorithm composes one option of `algorithm/advantage` and an ordered list of `algorithm/transforms`
options (Hydra's select-multiple pattern: the list's order is the order the transforms run). The
named conditions (`maxrl_gtpo_sepa`, ...) are every advantage option × `SEED_TRANSFORMS`, generated into
Hydra's ConfigStore by retrain/config.py; nothing pairs them by hand. `algorithm.name` and
`algorithm.label` are derived from the composed parts, so swapping a part renames the run.
The hyper-parameter sections (`gtpo`, `hicra`, `sepa`, `planning`) always exist, so an override
such as `algorithm.gtpo.beta=0.2` composes for every condition of a sweep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf

from retrain.algorithm.grams import DEFAULT_GRAMS, DEFAULT_SEMANTIC_MODEL, DEFAULT_SEMANTIC_THRESHOLD

# The original retrain's transform modes (`transform_mode`, docs/migrate-config.md), each in execution order (SEPA rewrites the uncertainty GTPO then reads);
# condition `<advantage>_<mode>` runs them, the mode being named by `mode_name`.
SEED_TRANSFORMS: list[list[str]] = [
    [],
    ["gtpo"],
    ["gtpo", "hicra"],
    ["sepa", "gtpo"],
    ["sepa_amp", "gtpo"],
    ["sepa_amp_c", "gtpo"],
]
NAME_RESOLVER = "retrain_condition_name"
LABEL_RESOLVER = "retrain_condition_label"
_DERIVED = "${.advantage},${.transforms}"


@dataclass
class GTPOConfig:
    beta: float = 0.1  # uncertainty weighting strength; 0 = every token keeps A_i


@dataclass
class HICRAConfig:
    alpha: float = 0.2  # planning-token amplification in [0, 1]; 0 = off


@dataclass
class SEPASettings:
    """The SEPA schedule's hyper-parameters: `algorithm.sepa.*`, and the fields `SEPASchedule` is built from."""

    steps: int = 500  # linear ramp length
    schedule: str = "linear"  # linear | auto
    delay_steps: int = 50  # lambda stays 0 for these steps
    correct_rate_gate: float = 0.1  # lambda stays 0 until a step reaches this correct rate (sticky)
    ema_decay: float = 0.99  # auto: decay of the execution-variance EMA
    warmup: int = 50  # auto: steps before the variance baseline is fixed
    var_threshold: float = 0.2  # auto: lambda reaches 1 when variance falls to this fraction of baseline


@dataclass
class SEPAConfig(SEPASettings):
    _target_: str = "retrain.algorithm.sepa.SEPASchedule"


@dataclass
class PlanningConfig:
    _target_: str = "retrain.algorithm.planning.PlanningDetector"
    grams: Any = field(default_factory=lambda: list(DEFAULT_GRAMS))  # list, JSON array or CSV string
    detector: str = "regex"  # regex (the grams' words) | semantic (clauses that mean a gram; the [semantic] extra)
    model: str = DEFAULT_SEMANTIC_MODEL  # semantic: the sentence-transformers encoder (Hub id or local dir)
    threshold: float = DEFAULT_SEMANTIC_THRESHOLD  # semantic: cosine similarity to the nearest gram, in (-1, 1]


@dataclass
class AlgorithmConfig:
    _target_: str = "retrain.algorithm.pipeline.Algorithm"
    _convert_: str = "all"  # parts receive plain lists/dicts, not OmegaConf nodes
    name: str = f"${{{NAME_RESOLVER}:{_DERIVED}}}"  # condition name: run dirs, wandb, metrics' `condition`
    label: str = f"${{{LABEL_RESOLVER}:{_DERIVED}}}"  # console label, e.g. maxrl+gtpo_sepa
    advantage: Any = MISSING  # {_target_: <(rewards [B, G]) -> [B, G]>, _partial_: true}
    uncertainty: str = "surprisal"  # surprisal | predictive_variance | shannon_entropy | aliases | module.fn
    transforms: dict[str, Any] = field(default_factory=dict)  # ordered {key: {_target_: ...} | null}
    surprisal_mask_rho: float = 0.0  # > 0: keep only each group's top-rho most uncertain tokens
    batch_advantage_norm: bool = False  # normalise nonzero token advantages over the step
    adv_clip_max: float = 0.0  # > 0: clamp nonzero token advantages to [-cap, cap]
    gtpo: GTPOConfig = field(default_factory=GTPOConfig)
    hicra: HICRAConfig = field(default_factory=HICRAConfig)
    sepa: SEPAConfig = field(default_factory=SEPAConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)


SCHEMAS: dict[str, type] = {"base_algorithm": AlgorithmConfig}


def mode_name(names: list[str]) -> str:
    """The transforms part of a condition name (the original `transform_mode`), from its transforms' names in
    execution order.

    As the original retrain named its modes: `none` without any, else `gtpo` first (every such mode is GTPO and
    what modifies it) and the others in the order they run: [sepa, gtpo] -> gtpo_sepa.
    """
    if not names:
        return "none"
    return "_".join(sorted(names, key=lambda name: name != "gtpo"))  # a stable sort keeps the rest in order


class Conditions:
    """The options of conf/algorithm/{advantage,transforms}/: the named conditions and the derived names.

    A composed part is named by the option it came from (found by content, so `algorithm/advantage=rloo`
    or `algorithm.transforms.sepa.floor_at_zero=true` rename the run); a part of your own is named by
    its function (an advantage) or by its key in `algorithm.transforms` (a transform).
    """

    def __init__(self, algorithm_dir: Path) -> None:
        self.advantages = _options(algorithm_dir / "advantage")
        self.transforms = _options(algorithm_dir / "transforms")

    def presets(self) -> dict[str, dict[str, Any]]:
        """Every advantage option with every seed transform mode, as defaults lists for the ConfigStore."""
        presets = {}
        for advantage in self.advantages:
            for transforms in SEED_TRANSFORMS:
                defaults = ["base_algorithm", {"advantage": advantage}, {"transforms": transforms}, "_self_"]
                presets[f"{advantage}_{mode_name(transforms)}"] = {"defaults": defaults}
        return presets

    def name(self, advantage: Any, transforms: Any) -> str:
        """`<advantage>_<transforms>`, e.g. maxrl_gtpo_sepa (the `retrain_condition_name` resolver)."""
        return f"{self.advantage_name(advantage)}_{self.transforms_name(transforms)}"

    def label(self, advantage: Any, transforms: Any) -> str:
        """`<advantage>+<transforms>`, e.g. maxrl+gtpo_sepa (the `retrain_condition_label` resolver)."""
        return f"{self.advantage_name(advantage)}+{self.transforms_name(transforms)}"

    def advantage_name(self, advantage: Any) -> str:
        node = _raw(advantage)
        found = next((name for name, option in self.advantages.items() if _same_part(option, node)), None)
        return found or str(node.get("_target_", "advantage")).rsplit(".", 1)[-1]

    def transforms_name(self, transforms: Any) -> str:
        names = []
        for key, node in _raw(transforms).items():
            if node is None:  # switched off with `algorithm.transforms.<key>=null`
                continue
            found = (
                name
                for name, option in self.transforms.items()
                if set(option) == {key} and _same_part(option[key], node)
            )
            names.append(next(found, str(key)))
        return mode_name(names)


def _options(group_dir: Path) -> dict[str, Any]:
    return {path.stem: yaml.safe_load(path.read_text()) or {} for path in sorted(group_dir.glob("*.yaml"))}


def _raw(node: Any) -> dict[str, Any]:
    """A resolver's node argument as a plain dict, interpolations left as written."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=False)  # type: ignore[return-value]
    return dict(node) if isinstance(node, Mapping) else {}


def _same_part(option: Any, node: Any) -> bool:
    """Same keys and the same values, except where the option interpolates (a hyper-parameter such as
    `beta: ${...gtpo.beta}` is a setting of the part, not what it is)."""
    if not isinstance(option, Mapping) or not isinstance(node, Mapping) or set(option) != set(node):
        return False
    return all((isinstance(value, str) and "${" in value) or node[key] == value for key, value in option.items())
