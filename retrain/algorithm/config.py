"""Typed schema of the `algorithm` config group (registered in Hydra's ConfigStore by retrain/config.py).

Presets in conf/algorithm/ start with `defaults: [base_algorithm, advantage: ..., transform@_here_: ...]`.
The hyper-parameter sections (`gtpo`, `hicra`, `sepa`, `planning`) always exist, so an override
such as `algorithm.gtpo.beta=0.2` composes for every preset of a sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from retrain.algorithm.grams import DEFAULT_GRAMS


@dataclass
class GTPOConfig:
    beta: float = 0.1  # uncertainty weighting strength; 0 = every token keeps A_i


@dataclass
class HICRAConfig:
    alpha: float = 0.2  # planning-token amplification in [0, 1]; 0 = off


@dataclass
class SEPAConfig:
    _target_: str = "retrain.algorithm.sepa.SEPASchedule"
    steps: int = 500  # linear ramp length
    schedule: str = "linear"  # linear | auto
    delay_steps: int = 50  # lambda stays 0 for these steps
    correct_rate_gate: float = 0.1  # lambda stays 0 until a step reaches this correct rate (sticky)
    ema_decay: float = 0.99  # auto: decay of the execution-variance EMA
    warmup: int = 50  # auto: steps before the variance baseline is fixed
    var_threshold: float = 0.2  # auto: lambda reaches 1 when variance falls to this fraction of baseline


@dataclass
class PlanningConfig:
    _target_: str = "retrain.algorithm.planning.PlanningDetector"
    grams: Any = field(default_factory=lambda: list(DEFAULT_GRAMS))  # list, JSON array or CSV string


@dataclass
class AlgorithmConfig:
    _target_: str = "retrain.algorithm.pipeline.Algorithm"
    _convert_: str = "all"  # parts receive plain lists/dicts, not OmegaConf nodes
    name: str = MISSING  # condition name: run dirs, wandb group, metrics' `condition`
    label: str = MISSING  # console label, e.g. maxrl+gtpo_sepa
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
