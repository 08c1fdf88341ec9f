"""Composition root: the only place that turns the config into parts and wires them together.

Order matters: everything that can be checked without a model (algorithm preflight against the
backend's declared capabilities, the reward, the data) is built first, so a bad config fails in
seconds, before gigabytes of weights load.
"""

from __future__ import annotations

import fcntl
import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from retrain.algorithm.preflight import preflight
from retrain.backend.base import capabilities_of
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.campaign.preemption import requeue_on_preemption
from retrain.checkpoint import latest_checkpoint, read_state
from retrain.config import check_known_keys
from retrain.errors import ConfigError
from retrain.reward.scorer import RewardScorer
from retrain.trainer import Trainer, TrainerSettings, WandbSettings
from retrain.types import SamplingParams

log = logging.getLogger("retrain")


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Build every part from `cfg` and train; returns the final status."""
    run_dir = run_dir or Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_known_keys(cfg)
    with exclusive_run_dir(run_dir):
        return _run(cfg, run_dir)


def _run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    training = cfg.training

    algorithm = instantiate(cfg.algorithm)
    backend_cls = get_class(cfg.backend._target_)
    capabilities = capabilities_of(backend_cls)
    engine_returns_entropies = bool(getattr(get_class(cfg.inference._target_), "returns_entropies", False))
    preflight(algorithm, capabilities, backend_name=backend_cls.__name__,
              engine_returns_entropies=engine_returns_entropies)

    resume = find_resume_checkpoint(cfg, run_dir)
    identity = config_identity(cfg)
    if resume is not None and not cfg.resume["from"]:
        check_same_run(read_state(resume).get("config_identity", {}), identity, run_dir)
    seed = resolve_seed(training.seed, resume)
    data = instantiate(cfg.data, seed=seed)
    log.info("Loaded %d examples (%s)", len(data), cfg.data._target_)
    scorer = RewardScorer(instantiate(cfg.reward), name=str(cfg.reward._target_),
                          timeout_s=cfg.scoring.timeout_s, workers=cfg.scoring.workers)

    model_spec = instantiate(cfg.model)
    # a partial first: Hydra would turn dataclass kwargs back into configs
    backend = instantiate(cfg.backend, _partial_=True)(
        model=model_spec, engine=instantiate(cfg.inference), seed=seed,
        optim=OptimSettings(lr=training.lr, weight_decay=training.weight_decay,
                            betas=tuple(training.betas), eps=training.eps,
                            max_grad_norm=training.max_grad_norm),
        loss=LossSettings(clip_eps=training.clip_eps,
                          clip_eps_high=training.clip_eps_high if training.clip_eps_high is not None
                          else training.clip_eps),
    )
    settings = TrainerSettings(
        max_steps=training.max_steps, batch_size=training.batch_size, group_size=training.group_size,
        sampling=SamplingParams(max_tokens=training.max_tokens, temperature=training.temperature,
                                top_p=training.top_p, return_entropies=algorithm.needs_entropies),
        save_every=training.save_every, seed=seed, condition=algorithm.name, label=algorithm.label,
        eval_examples=cfg.eval.num_examples, eval_samples=cfg.eval.samples,
        console_groups=cfg.logging.console_groups, generations_per_step=cfg.logging.generations_per_step,
        progress_bar=cfg.logging.progress_bar,
    )
    trainer = Trainer(backend=backend, capabilities=capabilities, algorithm=algorithm, data=data,
                      scorer=scorer, settings=settings, run_dir=run_dir, resume_checkpoint=resume,
                      wandb=wandb_settings(cfg, algorithm.name, seed), config_identity=identity)
    try:
        with requeue_on_preemption(trainer):  # a cluster's pre-emption signal: finish the step, checkpoint, requeue
            return trainer.run()
    finally:
        scorer.close()
        backend.close()


@contextmanager
def exclusive_run_dir(run_dir: Path) -> Iterator[None]:
    """One process per run dir: two jobs that resolve to the same dir must not interleave writes."""
    with open(run_dir / ".retrain.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"run dir {run_dir} is in use by another retrain process; in a sweep that "
                              "varies more than algorithm and training.seed, add the varied keys to "
                              "hydra.sweep.subdir (see docs/configuration.md)") from None
        yield


# what may differ when a run dir is entered again: how long it runs, what it logs, where it reports
NOT_IDENTITY = {"resume", "logging", "eval", "scoring", "squeeze"}
NOT_IDENTITY_TRAINING = {"max_steps", "save_every"}


def config_identity(cfg: DictConfig) -> dict[str, Any]:
    """The settings that define a run's trajectory, flattened to dotted keys."""
    container = OmegaConf.to_container(cfg, resolve=True)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    walk({k: v for k, v in container.items() if k not in NOT_IDENTITY}, "")
    return {k: v for k, v in flat.items()
            if not (k.startswith("training.") and k.split(".", 1)[1] in NOT_IDENTITY_TRAINING)}


def check_same_run(saved: dict[str, Any], current: dict[str, Any], run_dir: Path) -> None:
    """Entering a run dir again continues that run only if it is the same run (else a clear error)."""
    differing = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    if differing and saved:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in differing[:5])
        raise ConfigError(f"run dir {run_dir} holds a run with a different config ({shown}); use a new "
                          "hydra.run.dir, or resume.from=<that dir> to continue it with the new settings")


def find_resume_checkpoint(cfg: DictConfig, run_dir: Path) -> Path | None:
    """`resume.from` (a run dir or a checkpoint dir), else this run dir's own latest checkpoint.

    The second case is what makes a requeued cluster job continue where it was killed.
    """
    source = str(cfg.resume["from"] or "")
    if source:
        path = Path(source).expanduser()
        if (path / "trainer_state.json").is_file():
            return path
        found = latest_checkpoint(path) if path.is_dir() else None
        if found is None:
            raise ConfigError(f"resume.from={source!r}: no checkpoint (trainer_state.json) found there")
        return found
    return latest_checkpoint(run_dir)


def resolve_seed(configured: int, resume: Path | None) -> int:
    """A resumed run keeps its seed; seed -1 draws one (and the checkpoint records it)."""
    if resume is not None:
        return int(read_state(resume)["seed"])
    if configured >= 0:
        return configured
    seed = secrets.randbelow(2**31)
    log.info("training.seed=-1: drew seed %d", seed)
    return seed


def wandb_settings(cfg: DictConfig, condition: str, seed: int) -> WandbSettings | None:
    logging_cfg = cfg.logging
    if not logging_cfg.wandb_project:
        return None
    return WandbSettings(
        project=logging_cfg.wandb_project, entity=logging_cfg.wandb_entity,
        group=logging_cfg.wandb_group, name=logging_cfg.wandb_run_name or f"{condition}_s{seed}",
        tags=list(logging_cfg.wandb_tags), config=OmegaConf.to_container(cfg, resolve=True),
    )
