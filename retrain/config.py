"""The typed schema of the primary config, and its registration in Hydra's ConfigStore.

Every group's options are typed by the dataclasses their own package exports as `SCHEMAS`; this
module registers them all so that a typo or a wrong type fails when the config is composed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, OmegaConf

from retrain.algorithm.config import LABEL_RESOLVER, NAME_RESOLVER, Conditions

# config group -> module whose SCHEMAS type that group's options
GROUP_SCHEMA_MODULES: dict[str, str] = {
    "backend": "retrain.backend.config",
    "model": "retrain.model.config",
    "inference": "retrain.inference.config",
    "algorithm": "retrain.algorithm.config",
    "reward": "retrain.reward.config",
    "data": "retrain.data.config",
}


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups; docs/advantages.md): groups whose rewards are all
    equal are dropped and more prompts are sampled until the step holds training.batch_size groups with signal."""

    enabled: bool = False
    max_draws: int = 3  # extra sampling rounds a step may draw (verl's max_num_gen_batches, less its first round)

    def __post_init__(self) -> None:
        from retrain.errors import ConfigError

        if self.max_draws < 0:
            raise ConfigError(
                f"training.dynamic_sampling.max_draws must be >= 0 (0 = filter only), got {self.max_draws}"
            )


@dataclass
class TrainingConfig:
    """Run-wide optimisation and sampling knobs (the original TOML format's [training] and [optimizer], docs/migrate-config.md).

    The only home of their defaults: OptimSettings, LossSettings and SamplingParams are built from
    this section (`from_config`), the batch size by the batching part (retrain/training/batching.py).
    """

    seed: int = -1  # -1: draw a seed at start (recorded in the run's state, so resume is exact)
    max_steps: int = 500
    batch_size: int = 8  # prompts per step
    group_size: int = 16  # completions per prompt
    max_tokens: int = 10240  # new tokens per completion
    temperature: float = 0.7
    top_p: float = 0.95  # nucleus sampling; old log-probs stay those of the full tempered distribution
    lr: float = 4e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    lr_schedule: str = "constant"  # constant | linear | cosine (docs/loss.md)
    warmup_steps: int = 0  # linear warmup from 0 over this many optimizer steps
    min_lr_ratio: float = 0.0  # linear and cosine decay to lr * min_lr_ratio at max_steps
    objective: str = "ppo"  # ppo (PPO/DAPO; pure IS with clip_eps 0) | gspo | gspo_token | cispo; docs/loss.md
    clip_eps: float | None = None  # ε; null: the objective's (ppo 0: pure importance-sampling loss)
    clip_eps_high: float | None = None  # ε_high (DAPO clip-higher); null: the objective's, else clip_eps
    loss_agg: str | None = (
        None  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_sum_norm; null: objective's
    )
    loss_agg_constant: float | None = None  # seq_sum_norm's divisor; null: batch_size * group_size * max_tokens
    kl_coef: float = 0.0  # > 0: adds kl_coef * k3 KL to the base model (adapter disabled) to the loss; docs/loss.md
    entropy_coef: float = 0.0  # > 0: subtracts entropy_coef * the token's entropy from its loss; docs/loss.md
    # sampler–trainer mismatch correction (docs/loss.md): none | tis | mask; null: none for inference=pytorch, else tis
    mismatch_mode: str | None = None
    mismatch_level: str = "token"  # token | sequence: the weight per token, or one per row (product of its tokens')
    mismatch_cap: float = 2.0  # tis: weight min(π_old_trainer / π_sampler, cap) (Yao et al. 2025's C)
    mismatch_lower: float = 0.5  # mask: tokens (rows) whose weight leaves [lower, upper] leave the loss (IcePop)
    mismatch_upper: float = 5.0
    updates_per_batch: int = 1  # passes over each batch (GRPO's μ, TRL num_iterations, verl ppo_epochs)
    mini_batches: int = 1  # optimizer steps per pass, the rows split by group (TRL steps_per_generation)
    save_every: int = 20  # checkpoint every N steps (and always at the end)
    keep_checkpoints: int = 0  # keep the newest N checkpoints/step_N (final/ always); 0 = keep all
    deterministic: bool = False  # also bit-exact on GPU: deterministic kernels, slower (docs/reproducibility.md)
    max_skipped_steps: int = 3  # stop after this many optimizer steps in a row skipped (non-finite); 0 = never
    # mean |engine − trainer| log-prob of the sampled tokens allowed at policy lag 0; None = by dtype (the probe's)
    logprob_diff_tolerance: float | None = None
    # optimizer steps a batch's weights may be older than the trainer's: the sampler runs up to this many steps
    # ahead on an engine with a device of its own (docs/async.md); null: 1 in split mode, else 0
    max_staleness: int | None = None
    threads: int = 0  # torch's CPU threads; 0: the usable CPUs, or OMP_NUM_THREADS (retrain/housekeeping/threads.py)
    # DAPO's overlong shaping (docs/rewards.md): completions in the last overlong_buffer_frac of max_tokens lose up
    # to overlong_penalty reward, linearly; 0 = off (verl: overlong_buffer.len / max length, .penalty_factor)
    overlong_buffer_frac: float = 0.0
    overlong_penalty: float = 1.0
    mask_truncated: bool = False  # rows that hit max_tokens carry no gradient (TRL's mask_truncated_completions)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)

    def __post_init__(self) -> None:
        from retrain.errors import ConfigError

        if self.keep_checkpoints < 0:
            raise ConfigError(f"training.keep_checkpoints must be >= 0 (0 keeps all), got {self.keep_checkpoints}")
        if self.max_skipped_steps < 0:
            raise ConfigError(
                f"training.max_skipped_steps must be 0 (never stop) or more, got {self.max_skipped_steps}"
            )
        if not 0 <= self.overlong_buffer_frac <= 1:
            raise ConfigError(
                f"training.overlong_buffer_frac must be in [0, 1] (a share of max_tokens; 0 = off), "
                f"got {self.overlong_buffer_frac}"
            )
        if not (math.isfinite(self.overlong_penalty) and self.overlong_penalty >= 0):
            raise ConfigError(f"training.overlong_penalty must be a finite number >= 0, got {self.overlong_penalty}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(
                f"training.max_staleness must be >= 0 (0 = on-policy; null = by engine), got {self.max_staleness}"
            )
        if self.logprob_diff_tolerance is not None and not self.logprob_diff_tolerance > 0:
            raise ConfigError(
                f"training.logprob_diff_tolerance must be > 0 (null = by dtype), got {self.logprob_diff_tolerance}"
            )


@dataclass
class ScoringConfig:
    """How a step's completions are scored."""

    timeout_s: float = 30.0  # a reward call that takes longer scores 0 and counts as an error
    workers: int = 0  # parallel reward worker processes; 0 = one per core (2 to 8)
    max_failing_steps: int = 3  # stop the run when no completion gets a score for this many steps in a row; 0 = never
    max_worker_rss_mb: int = 4096  # replace a worker holding more memory than this between chunks; 0 = no limit

    def __post_init__(self) -> None:
        from retrain.errors import ConfigError

        if not self.timeout_s > 0:
            raise ConfigError(f"scoring.timeout_s must be positive, got {self.timeout_s}")
        if self.workers < 0:
            raise ConfigError(f"scoring.workers must be 0 (one per core) or more, got {self.workers}")
        if self.max_failing_steps < 0:
            raise ConfigError(f"scoring.max_failing_steps must be 0 (never stop) or more, got {self.max_failing_steps}")
        if self.max_worker_rss_mb < 0:
            raise ConfigError(f"scoring.max_worker_rss_mb must be 0 (no limit) or more, got {self.max_worker_rss_mb}")


@dataclass
class LoggingConfig:
    """Console, jsonl and wandb logging (the original TOML format's [logging]; docs/logging.md)."""

    wandb_project: str = ""  # set to enable wandb
    wandb_entity: str = ""
    wandb_group: str = ""
    wandb_run_name: str = ""
    wandb_tags: list[str] = field(default_factory=list)
    console_groups: int = 2  # per step, print this many "group: k/G correct" lines
    generations_per_step: int = 4  # completions written to emergence/generations.jsonl per step
    # the step progress bar: auto = only when stdout is a terminal (never into nohup's or SLURM's log) | true | false
    progress_bar: str = "auto"
    tensorboard: bool = False  # also write TensorBoard event files into <run dir>/tensorboard (extra [tensorboard])


@dataclass
class EvalConfig:
    """Held-out accuracy before and after training, and every `every` steps between (when the data source
    has a held-out split)."""

    num_examples: int = 0  # 0 disables evaluation
    samples: int = 4  # sampled completions per held-out prompt (greedy always uses 1)
    every: int = 0  # also after every N steps trained (in step N's record, eval/*_accuracy); 0 = before/after only


@dataclass
class BackpressureConfig:
    """Adaptive batch size from measured throughput, the USL controller of retrain/training/backpressure.py (the
    original TOML format's [backpressure]; docs/backpressure.md). Off: every step samples `training.batch_size` prompts."""

    enabled: bool = False
    warmup_steps: int = 10  # steps sweeping batch sizes min, 2·min, 4·min, ..., max before the USL fit decides
    ema_decay: float = 0.9  # EMA decay of the throughput (tokens/s) at the current batch size
    throttle_margin: float = 0.85  # target concurrency as a fraction of the fitted optimum p*
    increase_margin: float = 0.5  # grow only below increase_margin·throttle_margin·p* (hysteresis)
    min_batch_size: int = 1  # floor of the adaptive batch size
    max_batch_size: int = 64  # ceiling of the adaptive batch size
    peak_gflops: float = 0.0  # hardware peak GFLOP/s for the roofline hint; 0 = no compute hint
    peak_bw_gb_s: float = 0.0  # hardware peak memory bandwidth (GB/s) for the roofline hint; 0 = no bandwidth hint

    def __post_init__(self) -> None:
        from retrain.errors import ConfigError

        checks = {
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "ema_decay": (0 <= self.ema_decay < 1, "in [0, 1)"),
            "throttle_margin": (0 < self.throttle_margin <= 1, "in (0, 1]"),
            "increase_margin": (0 < self.increase_margin <= 1, "in (0, 1]"),
            "min_batch_size": (self.min_batch_size >= 1, ">= 1"),
            "max_batch_size": (self.max_batch_size >= self.min_batch_size, f">= min_batch_size {self.min_batch_size}"),
            "peak_gflops": (self.peak_gflops >= 0, ">= 0 (0 = no hint)"),
            "peak_bw_gb_s": (self.peak_bw_gb_s >= 0, ">= 0 (0 = no hint)"),
        }
        for key, (valid, rule) in checks.items():
            if not valid:
                raise ConfigError(f"backpressure.{key} must be {rule}, got {getattr(self, key)}")


def _resume_config() -> type:
    """`resume.from` is a Python keyword, so this dataclass is built by hand (no generated __init__)."""
    namespace = {"__annotations__": {"from": str}, "from": "", "__doc__": "Where to resume from."}
    return dataclasses.dataclass(init=False, repr=False, eq=False)(type("ResumeConfig", (), namespace))


ResumeConfig = _resume_config()


@dataclass
class RetrainConfig:
    """The primary config: one option per group plus the run-wide sections."""

    backend: Any = MISSING
    model: Any = MISSING
    algorithm: Any = MISSING
    inference: Any = MISSING
    reward: Any = MISSING
    data: Any = MISSING
    training: TrainingConfig = field(default_factory=TrainingConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    backpressure: BackpressureConfig = field(default_factory=BackpressureConfig)
    resume: Any = field(default_factory=ResumeConfig)
    squeeze: Any = None  # campaign auto-squeeze settings (see docs/squeeze.md)


RUN_WIDE_SCHEMAS: dict[str, type] = {
    "training": TrainingConfig,
    "scoring": ScoringConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
    "backpressure": BackpressureConfig,
}


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys a `+key=value` override slipped past the schema (`+training.lrr=1` is a typo), with the key it
    most likely meant, as a typo Hydra refuses is named (retrain/config_checks/compose_errors.py).

    Group nodes may grow keys on purpose (plugin arguments: `+reward.scale=2`); the run-wide
    sections and the top level may not, since nothing would ever read them.
    """
    from retrain.config_checks.compose_errors import unknown_key_line
    from retrain.errors import ConfigError

    known_top = [f.name for f in dataclasses.fields(RetrainConfig)]
    for key in cfg:
        if key not in known_top:
            raise ConfigError(unknown_key_line(str(key), known_top))
    for section, schema in RUN_WIDE_SCHEMAS.items():
        known = [f.name for f in dataclasses.fields(schema)]
        for key in cfg[section]:
            if key not in known:
                raise ConfigError(unknown_key_line(f"{section}.{key}", known))


def container_dict(node: Any, key: str, *, resolve: bool = True) -> dict[str, Any]:
    """`OmegaConf.to_container` of the mapping node at `key`, as the plain str-keyed dict it is.

    ConfigError (naming `key`) when the node is not a mapping, or has a key that is not a string.
    """
    container = OmegaConf.to_container(node, resolve=resolve)
    if not _is_str_keyed(container):
        from retrain.errors import ConfigError

        raise ConfigError(f"{key}: expected a mapping with string keys, got {container!r}")
    return container


def container_list(node: Any, key: str, *, resolve: bool = True) -> list[Any]:
    """`OmegaConf.to_container` of the sequence node at `key`; ConfigError (naming `key`) when it is not one."""
    container = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(container, list):
        from retrain.errors import ConfigError

        raise ConfigError(f"{key}: expected a list, got {container!r}")
    return container


def _is_str_keyed(value: object) -> TypeGuard[dict[str, Any]]:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def register_configs() -> None:
    """Store the primary schema, every group's option schemas and the named conditions (idempotent)."""
    register_resolvers()
    store = ConfigStore.instance()
    if "retrain_schema.yaml" in store.list(""):  # stored already: storing converts every node again
        return
    store.store(name="retrain_schema", node=RetrainConfig)
    for group, module_name in GROUP_SCHEMA_MODULES.items():
        schemas: dict[str, type] = importlib.import_module(module_name).SCHEMAS
        for name, node in schemas.items():
            store.store(group=group, name=name, node=node)
    for name, preset in algorithm_conditions().presets().items():  # algorithm=maxrl_gtpo_sepa, ...
        store.store(group="algorithm", name=name, node=preset)


def register_resolvers() -> None:
    """The resolvers the composed config uses (idempotent).

    Also run when this module is imported: a submitit job resolves its run dir (`${algorithm.name}`)
    in a fresh process, after unpickling retrain's entry point but before any of retrain's code runs.
    """
    resolvers: dict[str, Callable[..., str]] = {
        "retrain_config_groups": config_groups_help,
        NAME_RESOLVER: lambda advantage, transforms: algorithm_conditions().name(advantage, transforms),
        LABEL_RESOLVER: lambda advantage, transforms: algorithm_conditions().label(advantage, transforms),
    }
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)


@functools.cache
def algorithm_conditions() -> Conditions:
    """The named conditions of conf/algorithm/ and the namer of composed algorithms."""
    return Conditions(Path(config_dir()) / "algorithm")


def config_dir() -> str:
    """conf/ inside an installed wheel, through an editable install, or at the top of a checkout."""
    packaged = Path(__file__).resolve().parent / "conf"
    if packaged.is_dir():
        return str(packaged)
    spec = importlib.util.find_spec("retrain.conf")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    return str(Path(__file__).resolve().parent.parent / "conf")


def compose(overrides: list[str] | None = None, return_hydra_config: bool = False) -> DictConfig:
    """The config exactly as `python -m retrain <overrides>` composes it (for notebooks, tests, benchmarks).

    `return_hydra_config` keeps the `hydra` node (launcher, sweeper, callbacks), e.g. to check
    `hydra/launcher=slurm` where no cluster answers.
    """
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [], return_hydra_config=return_hydra_config)


def config_groups() -> dict[str, list[str]]:
    """Every group and sub-group of conf/ with its options: YAML files and the generated named conditions."""
    root = Path(config_dir())
    groups = {p.relative_to(root).as_posix(): [f.stem for f in p.glob("*.yaml")] for p in root.rglob("*") if p.is_dir()}
    groups["algorithm"] += algorithm_conditions().presets()
    return {group: sorted(options) for group, options in sorted(groups.items()) if options}


def config_groups_help() -> str:
    """`--help`: each group with its options (the schemas behind them are not choices)."""
    return "\n".join(f"{group}: {', '.join(options)}" for group, options in config_groups().items())


register_resolvers()
