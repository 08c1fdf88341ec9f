"""Composition root: the only place that turns the config into parts and wires them together.

Order matters: everything that can be checked without a model (algorithm preflight against the
backend's declared capabilities, the reward, the data and its held-out split, the tokenizer's chat
template) is built first, so a bad config fails in seconds, before gigabytes of weights load.
Settings objects are built from their typed config section in one step each; parts that are not
retrain's own are wrapped so their outputs are checked against their contract (retrain.plugins).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import secrets
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from retrain.algorithm.base import Algorithm
from retrain.algorithm.checks import checked_algorithm
from retrain.algorithm.preflight import ProbeReport, preflight
from retrain.backend.base import BACKEND_CHECKS, Backend, Capabilities
from retrain.backend.capabilities import BackendInfo, describe_backend
from retrain.backend.config import auto_switch
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.campaign.preemption import requeue_on_preemption
from retrain.config import (
    BackpressureConfig,
    EvalConfig,
    LoggingConfig,
    TrainingConfig,
    container_dict,
)
from retrain.config_checks.validation import check_prompt_lengths, check_run_config, model_context, warn_if_untrainable
from retrain.data.prompts import template_line
from retrain.distributed.agreement import check_same_data, check_same_settings
from retrain.distributed.failures import clear_earlier_notes, rank_failures_recorded
from retrain.distributed.rendezvous import check_one_device_per_rank, planned_local_ranks
from retrain.distributed.world import World, from_main, join_world, leave_world, rank_devices
from retrain.environments.base import RolloutEnvironment
from retrain.error_lines import failure_line
from retrain.errors import CheckpointError, ConfigError, UserError
from retrain.housekeeping.allocator import keep_freed_memory
from retrain.housekeeping.console import done_line, run_dir_line
from retrain.housekeeping.determinism import reproducible_torch
from retrain.housekeeping.launch import claimed_run_dir, record_launch
from retrain.housekeeping.rundir import STATE_FILE, Checkpoint, RunDir
from retrain.housekeeping.secrets import shown_config
from retrain.housekeeping.threads import fitted_threads, ignored_settings, set_torch_threads
from retrain.inference.base import ENGINE_CHECKS, InferenceEngine
from retrain.inference.endpoint import EngineEndpoint
from retrain.inference.pytorch import PytorchEngine
from retrain.inference.reachable import check_server_answers
from retrain.model.cuda_allocator import use_expandable_segments
from retrain.model.memory_plan import MemoryPlan, plan_on_this_machine, plans_local_memory
from retrain.model.probe import Probe
from retrain.model.spec import ChatPrompts, ModelSpec
from retrain.objective.support import check_objective_support
from retrain.plugins import checked, import_failure, locate, plugin_name
from retrain.reward.scorer import RewardScorer
from retrain.training.batching import build_batching
from retrain.training.metrics_log import check_tensorboard, check_wandb_login
from retrain.training.staleness import resolve_max_staleness
from retrain.training.trainer import PlanningDetection, Trainer
from retrain.types import Example

log = logging.getLogger("retrain")


def run(cfg: DictConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """Build every part from `cfg` and train; returns the final status."""
    run_dir = run_dir or Path(HydraConfig.get().runtime.output_dir)
    use_expandable_segments()  # before CUDA initialises: it reads the setting then
    # one process, or this rank of a torchrun / submitit multi-task run (docs/distributed.md)
    world = join_world(str(OmegaConf.select(cfg, "backend.devices", default="cpu")))
    try:
        attempt = from_main(secrets.token_hex(6))  # this launch's id, for its ranks' failure notes
        return run_as(world, cfg, on_main_run_dir(world, run_dir), attempt)
    finally:
        leave_world()


def on_main_run_dir(world: World, own: Path) -> Path:
    """Rank 0's run dir on every rank: Hydra's time-stamped dir may differ by a second between ranks. Another
    rank stops logging into its own dir (rank 0 alone writes run.log) and removes it if nothing else is there."""
    run_dir = Path(from_main(str(own)))
    if world.is_main:
        if world.distributed:
            log.info(world.line())
        return run_dir
    for handler in list(logging.root.handlers):
        if isinstance(handler, logging.FileHandler):
            logging.root.removeHandler(handler)
            handler.close()
    logging.getLogger("retrain").setLevel(logging.WARNING)  # one console: rank 0's
    if own != run_dir and own.is_dir() and {p.name for p in own.iterdir()} <= {"run.log"}:
        (own / "run.log").unlink(missing_ok=True)
        own.rmdir()
    return run_dir


def run_as(world: World, cfg: DictConfig, run_dir: Path, attempt: str = "") -> dict[str, Any]:
    """`run` on this rank: rank 0 claims the run dir and writes it; every rank builds its parts and trains. A rank
    that fails leaves its error for rank 0 to record (retrain.distributed.failures)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    check_run_config(cfg)
    if world.distributed:
        check_same_settings(cfg)  # every rank computes the same step (retrain/distributed/agreement.py)
    identity = config_identity(cfg)
    keep_freed_memory()  # each step reuses the host memory of the step before instead of faulting it in anew
    # nothing is written into the run dir before it is this run's (its run.log included): a refused launch
    # leaves it as it was
    claim: AbstractContextManager[None] = claimed_run_dir(run_dir, identity) if world.is_main else nullcontext()
    with claim, ExitStack() as parts, rank_failures_recorded(run_dir, world, attempt):
        if world.is_main:
            clear_earlier_notes(run_dir, attempt)
        log.info(run_dir_line(run_dir))
        use_usable_cpus(int(cfg.training.threads))
        with failure_recorded(run_dir) if world.is_main else nullcontext():  # a run that cannot start says why
            if world.is_main:
                record_launch(run_dir, cfg)
            trainer = build_trainer(cfg, run_dir, parts, world)
            # SIGTERM, Ctrl-C, a cluster's pre-emption signal: finish the step, checkpoint, then exit (or requeue)
            parts.enter_context(requeue_on_preemption(trainer))
            parts.enter_context(
                reproducible_torch(trainer.training.deterministic, getattr(trainer.backend, "device", None))
            )
        status = trainer.run()  # records its own end (done, stopped, failed) in status.json
        if status["state"] == "done":
            log.info(done_line(status, run_dir))
        return status


def use_usable_cpus(configured: int) -> None:
    """torch computes with as many threads as the idle CPUs this process may use (retrain/housekeeping/threads.py); logged."""
    for ignored in ignored_settings():
        log.warning(ignored)
    choice = fitted_threads(configured)
    set_torch_threads(choice.threads)
    log.info(choice.line())


@contextmanager
def failure_recorded(run_dir: Path) -> Iterator[None]:
    """An error raised while the run is built is recorded as `failed` in status.json, with the one line
    the console shows, so `retrain status` says why instead of `dead ... updated never`."""
    try:
        yield
    except Exception as error:
        RunDir(run_dir).record_failure(failure_line(error))
        raise


def build_trainer(cfg: DictConfig, run_dir: Path, parts: ExitStack, world: World | None = None) -> Trainer:
    """Every part, built from `cfg` and wired into a Trainer; `parts` closes them when it exits."""
    world = world or World()
    training: TrainingConfig = OmegaConf.to_object(cfg.training)  # type: ignore[assignment]
    plan = plan_parts(cfg)
    check_data_parallel(cfg, plan, world)
    check_dynamic_sampling(cfg, plan, world)
    algorithm, backend_cls, capabilities = plan.algorithm, plan.backend_cls, plan.backend.capabilities
    flags = ", ".join(f"{key}={value}" for key, value in capabilities.as_dict().items())
    log.info("backend %s: %s (source=%s)", plan.backend.name, flags, plan.backend.source)
    plan.preflight()  # first: what an algorithm cannot do on this backend, before what the backend still lacks
    plan.check_options()
    check_kl_support(training, backend_cls)
    check_objective_support(training, backend_cls)
    warn_if_untrainable(algorithm, training)
    check_wandb_login(str(cfg.logging.wandb_project))
    check_tensorboard(bool(cfg.logging.tensorboard))
    if not capabilities.samples_itself:  # a dead server is found in seconds, before the model loads
        check_server_answers(container_dict(cfg.inference, "inference"))
    memory = checked_memory_plan(cfg)

    # rank 0 looks (and sets a damaged checkpoint aside); every rank resumes from what it found
    resume = from_main(find_resume_checkpoint(cfg, run_dir, checkpoint_files(backend_cls)) if world.is_main else None)
    identity = config_identity(
        cfg
    )  # checked against the run dir's when it was claimed (retrain/housekeeping/launch.py)
    seed = from_main(resolve_seed(training.seed, resume))  # seed -1: rank 0's draw
    training = replace(training, seed=seed, max_staleness=checked_max_staleness(cfg, training, plan, world))
    backpressure: BackpressureConfig = OmegaConf.to_object(cfg.backpressure)  # type: ignore[assignment]  # checked now
    # the reward first: its mistakes (arguments, a worker that cannot load it) before a data set's download
    scorer = RewardScorer(
        build_part(cfg, "reward"),
        timeout_s=cfg.scoring.timeout_s,
        workers=cfg.scoring.workers,
        max_failing_steps=cfg.scoring.max_failing_steps,
        max_worker_rss_mb=cfg.scoring.max_worker_rss_mb,
    )
    parts.callback(scorer.close)
    data = build_part(cfg, "data", seed=seed)
    log.info("Loaded %d examples (%s)", len(data), cfg.data._target_)
    if "prompt_template" in cfg.data:
        log.info("%s", template_line(str(cfg.data.prompt_template)))
    evaluation: EvalConfig = OmegaConf.to_object(cfg.eval)  # type: ignore[assignment]
    eval_examples = held_out_examples(data, evaluation.num_examples)
    if world.distributed:
        check_same_data(cfg, data, eval_examples)

    model: ModelSpec = build_part(cfg, "model")
    tokenizer = model.load_tokenizer()
    prompts = ChatPrompts(tokenizer, model.name_or_path)
    check_prompt_lengths([*getattr(data, "train_examples", []), *eval_examples], tokenizer, model, training.max_tokens)
    backend: Backend = checked(
        build_part(
            with_rank_devices(with_resolved_checkpointing(cfg, memory), world),
            "backend",
            model=model,
            optim=OptimSettings.from_config(training),
            loss=LossSettings.from_config(
                training, sampler_is_trainer=sampler_is_trainer(plan) and training.max_staleness == 0
            ),
            seed=seed,
        ),
        BACKEND_CHECKS,
        f"backend {plugin_name(backend_cls)}",
    )
    parts.callback(backend.close)
    engine = build_engine(cfg, backend, capabilities, tokenizer, automatic_kv_bytes(cfg, memory))
    batching = build_batching(backpressure, training.batch_size, training.group_size, backend.engine_resources().model)
    parts.callback(engine.close)
    if isinstance(data, RolloutEnvironment):
        connect_environment(data, engine, tokenizer, model, parts)
        if getattr(data, "uses_reward", False):
            log.info(
                "data %s samples its own episodes; reward=%s scores their last replies",
                plugin_name(data),
                cfg.reward._target_,
            )
        else:
            log.info(
                "data %s samples and scores its own episodes; reward=%s is not used",
                plugin_name(data),
                cfg.reward._target_,
            )
    output: LoggingConfig = OmegaConf.to_object(cfg.logging)  # type: ignore[assignment]
    run_config = shown_config(cfg)  # what wandb records: no environment value, no secret
    return Trainer(
        backend=backend,
        engine=engine,
        algorithm=algorithm,
        planning=planning_detection(algorithm, tokenizer),
        data=data,
        eval_examples=eval_examples,
        scorer=scorer,
        prompts=prompts,
        probe=Probe.from_tokenizer(tokenizer),
        batching=batching,
        training=training,
        evaluation=evaluation,
        output=output,
        run_dir=run_dir,
        resume_checkpoint=resume,
        run_config=run_config,
        config_identity=identity,
        world=world,
        pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0,
    )


def sampler_is_trainer(plan: PartsPlan) -> bool:
    """Whether the rollouts' log-probs come from the trainer's own model (inference=pytorch: the mismatch
    correction is off by default unless it samples ahead, training.max_staleness > 0) or from another engine (vLLM,
    SGLang, a server: tis by default); a backend that samples itself corrects nothing (docs/loss.md)."""
    return plan.backend.capabilities.samples_itself or issubclass(plan.engine_cls, PytorchEngine)


def checked_max_staleness(cfg: DictConfig, training: TrainingConfig, plan: PartsPlan, world: World) -> int:
    """`training.max_staleness` resolved for this run's parts (retrain.training.staleness), logged when it samples
    ahead; a ConfigError naming the key when its engine cannot, before any model loads."""
    k = resolve_max_staleness(
        training.max_staleness,
        devices=str(OmegaConf.select(cfg, "backend.devices", default="")),
        engine_cls=plan.engine_cls,
        samples_itself=plan.backend.capabilities.samples_itself,
        ranks=world.size,
    )
    if k > 0:
        log.info("training.max_staleness=%d: the engine samples up to %d optimizer steps ahead (docs/async.md)", k, k)
    return k


def check_data_parallel(cfg: DictConfig, plan: PartsPlan, world: World) -> None:
    """A run on several ranks needs one device per rank (no split mode) and parts that can split a step: a backend
    that all-reduces its gradients (`data_parallel`), an engine that samples a share of a batch by global row ids
    (`row_offset`), a data source whose prompts the trainer samples, and at least one group per rank."""
    if not world.distributed:
        return
    check_one_device_per_rank(str(OmegaConf.select(cfg, "backend.devices", default="cpu")), world.size)
    where = f"a run on {world.size} ranks (docs/distributed.md)"
    if not getattr(plan.backend_cls, "data_parallel", False):
        raise ConfigError(
            f"backend {plugin_name(plan.backend_cls)} cannot train data-parallel: {where} needs backend=local"
        )
    if not _takes_row_offset(plan.engine_cls):
        raise ConfigError(
            f"inference engine {plan.engine_cls.__name__} cannot sample a share of a batch: {where} needs an engine "
            "whose generate takes row_offset (pytorch, vllm, vllm_server, sglang, openai)"
        )
    if _runs_own_episodes(cfg):
        raise ConfigError(f"data={cfg.data._target_} runs its own episodes, which cannot yet be split: {where}")
    batch_size, samples = int(cfg.training.batch_size), int(cfg.eval.num_examples)
    if batch_size < world.size or 0 < samples % batch_size < world.size:
        raise ConfigError(
            f"training.batch_size={batch_size}, eval.num_examples={samples}: {where} gives each rank at least one "
            f"prompt of every batch (held-out ones go in batches of training.batch_size)"
        )


def check_dynamic_sampling(cfg: DictConfig, plan: PartsPlan, world: World) -> None:
    """Dynamic sampling's refill rounds (retrain/training/dynamic_sampling.py) sample rows numbered after the step's
    first round (`row_offset`): they need an engine that takes it and a data source whose prompts the trainer samples;
    a data-parallel run's rounds would need the ranks to agree on every refill, not done yet."""
    if not OmegaConf.select(cfg, "training.dynamic_sampling.enabled", default=False):
        return
    key = "training.dynamic_sampling.enabled"
    if world.distributed:
        raise ConfigError(f"{key}: dynamic sampling is not supported on {world.size} ranks yet; run it on one process")
    if not _takes_row_offset(plan.engine_cls):
        raise ConfigError(
            f"{key}: inference engine {plan.engine_cls.__name__} cannot number a refill round's rows (row_offset); "
            "use pytorch, vllm, vllm_server, sglang or openai"
        )
    if _runs_own_episodes(cfg):
        raise ConfigError(f"{key}: data={cfg.data._target_} runs its own episodes, which refill rounds cannot seed")


def _takes_row_offset(engine_cls: type) -> bool:
    """Whether the engine can sample rows numbered from an offset: a rank's share, or a refill round."""
    generate = getattr(engine_cls, "generate", None)
    return generate is not None and "row_offset" in inspect.signature(generate).parameters


def _runs_own_episodes(cfg: DictConfig) -> bool:
    """Whether the data source is an environment that samples its own episodes (not the trainer's prompts)."""
    data = target_object(cfg, "data")
    return isinstance(data, type) and issubclass(data, RolloutEnvironment)


def with_rank_devices(cfg: DictConfig, world: World) -> DictConfig:
    """`cfg` with this rank's `backend.devices` (retrain.distributed.world.rank_devices); one process: as it was."""
    if not world.distributed:
        return cfg
    ranked = copy.deepcopy(cfg)
    if "devices" in ranked.backend:
        ranked.backend.devices = rank_devices(str(cfg.backend.devices), world)
    return ranked


@dataclass(frozen=True)
class PartsPlan:
    """What can be known of a run's parts before any model loads: the algorithm, the backend (described,
    its options checked) and the class of the engine that will sample."""

    algorithm: Algorithm
    backend_cls: type
    backend: BackendInfo
    backend_settings: dict[str, Any]  # the `backend.*` keys as composed
    engine_cls: type

    def preflight(self) -> ProbeReport:
        """The algorithm on a synthetic step against what the backend and engine can serve (ConfigError if not)."""
        return preflight(
            self.algorithm,
            self.backend.capabilities,
            backend_name=self.backend.name,
            engine_returns_entropies=bool(getattr(self.engine_cls, "returns_entropies", False)),
            engine_name=self.engine_cls.__name__,
        )

    def check_options(self) -> None:
        """The `backend.*` values against the backend's option schema (ConfigError naming the key)."""
        self.backend.check_options(self.backend_settings)


def plan_parts(cfg: DictConfig) -> PartsPlan:
    """The run's algorithm, backend description and engine class, without building a backend or an engine."""
    algorithm = checked_algorithm(instantiate(cfg.algorithm))
    backend_cls = target_class(cfg, "backend")
    backend = describe_backend(backend_cls)
    engine_cls = backend_cls if backend.capabilities.samples_itself else target_class(cfg, "inference")
    return PartsPlan(algorithm, backend_cls, backend, container_dict(cfg.backend, "backend"), engine_cls)


def checked_memory_plan(cfg: DictConfig) -> MemoryPlan | None:
    """The run's memory plan on this machine's devices, logged; a run that cannot fit stops here, before any
    weight loads, naming the knob that fixes it (docs/capacity-planning.md, "Memory")."""
    config = container_dict(cfg, "config")
    memory = plan_on_this_machine(config, planned_local_ranks({}))
    if memory is None:
        if plans_local_memory(config):
            log.info(
                "no memory plan: the config.json of model.name_or_path=%s is not on this machine",
                cfg.model.name_or_path,
            )
        return None
    log.info("%s", memory.table())
    problem = memory.problem()
    if problem is not None:
        if "gpu:" in str(cfg.backend.devices) and memory.devices[0].device == "cpu":
            problem += (
                "; no CUDA device is visible, so it would train on the CPU (the offline demo: experiment=quickstart)"
            )
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path}: {problem}")
    return memory


def with_resolved_checkpointing(cfg: DictConfig, memory: MemoryPlan | None) -> DictConfig:
    """`cfg` with `backend.gradient_checkpointing=auto` replaced by the plan's choice, so the backend receives true
    or false; without a plan (a plugin backend, an unknown model) as it was. The run's identity keeps `auto`."""
    setting = OmegaConf.select(cfg, "backend.gradient_checkpointing", default="false")
    if memory is None or auto_switch(setting) != "auto":
        return cfg
    resolved = copy.deepcopy(cfg)
    on = memory.checkpointing
    resolved.backend.gradient_checkpointing = "true" if on else "false"
    log.info("backend.gradient_checkpointing=auto: %s (the memory plan)", "on" if on else "off")
    return resolved


def automatic_kv_bytes(cfg: DictConfig, memory: MemoryPlan | None) -> int | None:
    """The KV budget the plan sets for `inference.kv_cache_gb=0` on a known device; None: the engine's own."""
    if memory is None or memory.inputs.engine != "pytorch" or memory.inputs.kv_cache_gb > 0:
        return None
    if any(device.total_bytes is None for device in memory.devices):
        return None
    return memory.kv_budget_bytes


def check_kl_support(training: TrainingConfig, backend_cls: type) -> None:
    """`training.kl_coef > 0` needs a backend that can compute the base model's log-probs (`kl_to_base`)."""
    if training.kl_coef > 0 and not getattr(backend_cls, "kl_to_base", False):
        raise ConfigError(
            f"training.kl_coef={training.kl_coef}: backend {plugin_name(backend_cls)} has no KL to the base model "
            "(backend=local has); set training.kl_coef=0"
        )


def build_engine(
    cfg: DictConfig, backend: Backend, capabilities: Capabilities, tokenizer: Any, kv_cache_bytes: int | None = None
) -> InferenceEngine:
    """The backend's own sampler when it samples itself (a remote service), else `inference=...` built
    beside it from what it shares (with the memory plan's KV budget, `kv_cache_bytes`, when it sets one). The two
    are always different objects, so the freshness proof compares two real paths: the sampler's log-probs
    against the training forward's."""
    if capabilities.samples_itself:
        log.info("backend %s samples itself; inference=%s is not used", plugin_name(backend), cfg.inference._target_)
        engine = backend.sampling_engine(tokenizer)  # type: ignore[attr-defined]  # declared by samples_itself
    else:
        resources = backend.engine_resources()
        if kv_cache_bytes is not None:
            resources = replace(resources, kv_cache_bytes=kv_cache_bytes)
        engine = build_part(cfg, "inference", tokenizer=tokenizer, resources=resources)
    return checked(engine, ENGINE_CHECKS, f"inference engine {plugin_name(engine)}")


def connect_environment(
    environment: RolloutEnvironment, engine: InferenceEngine, tokenizer: Any, model: ModelSpec, parts: ExitStack
) -> None:
    """Serve the engine on a loopback OpenAI-compatible endpoint for the environment's episodes, for the whole run
    (it refuses a conversation that fills the model's context)."""
    endpoint = EngineEndpoint(engine, max_model_len=model_context(model))
    parts.callback(endpoint.close)
    environment.connect(endpoint, tokenizer, model.source()[0])


def planning_detection(algorithm: Algorithm, tokenizer: Any) -> PlanningDetection | None:
    """The algorithm's planning-token detector bound to the run's tokenizer, when the algorithm reads planning tokens."""
    if not algorithm.needs_planning:
        return None
    return functools.partial(algorithm.planning_mask, tokenizer=tokenizer)


def held_out_examples(data: Any, num_examples: int) -> list[Example]:
    """The `eval.num_examples` held-out problems, taken now so that a data source without them fails
    before any model loads (none when evaluation is off)."""
    if num_examples <= 0:
        return []
    held_out = getattr(data, "held_out", None)
    if held_out is None:
        raise ConfigError(
            f"eval.num_examples={num_examples}, but data source {plugin_name(data)} has no held-out "
            "split; set eval.num_examples=0 or choose data with one"
        )
    try:
        return list(held_out(num_examples))
    except ConfigError as error:
        raise ConfigError(
            f"eval.num_examples={num_examples}: {error}; or set eval.num_examples=0 to train without evaluation"
        ) from error


def build_part(cfg: DictConfig, group: str, **run_objects: Any) -> Any:
    """`<group>` built by Hydra's plain `instantiate`, with the objects only the run has (a tokenizer, the model
    spec, the seed): one path for a built-in and a plugin alike (docs/plugins.md). A built-in converts the keys it
    is given through its schema (retrain.settings_object), so each setting is declared in the schema only.
    """
    node = cfg[group]
    try:
        if run_objects and (node.get("_partial_") or any(dataclasses.is_dataclass(v) for v in run_objects.values())):
            # a partial first: Hydra would turn dataclass arguments (a ModelSpec, EngineResources) back into configs
            return instantiate(node, _partial_=True)(**run_objects)
        return instantiate(node, **run_objects)  # a reward function stays the partial its `_partial_: true` asks for
    except InstantiationException as error:
        cause = error.__cause__
        if not isinstance(cause, UserError):
            raise
        cause.__suppress_context__ = (
            True  # the user's mistake as the part said it (naming its key), not Hydra's wrapper
        )
        raise cause from cause.__cause__


def target_object(cfg: DictConfig, group: str) -> Any:
    """What `<group>._target_` names (a class or a function); one that does not import is a ConfigError saying why."""
    target = str(cfg[group]._target_)
    try:
        return locate(target)
    except (ImportError, ValueError) as error:
        raise ConfigError(f"{group}._target_={target!r} cannot be imported: {import_failure(error)}") from error


def target_class(cfg: DictConfig, group: str) -> type:
    """The class `<group>._target_` names; one that does not import, or is no class, is a ConfigError."""
    found = target_object(cfg, group)
    if not isinstance(found, type):
        raise ConfigError(f"{group}._target_={str(cfg[group]._target_)!r} is a {type(found).__name__}, not a class")
    return found


# what may differ when a run dir is entered again: how long it runs, what it logs, where it reports
NOT_IDENTITY = {"resume", "logging", "eval", "scoring", "squeeze"}
# keys of the other sections that may differ too: how long it runs, back-pressure's roofline hints (never acted
# on), and where the inference server listens (a server restarted on another port serves the same run)
NOT_IDENTITY_KEYS = {
    "training": {"max_steps", "save_every", "keep_checkpoints", "threads"},
    "inference": {"url"},
    "backpressure": {"peak_gflops", "peak_bw_gb_s"},
}


def config_identity(cfg: DictConfig) -> dict[str, Any]:
    """The settings that define a run's trajectory, flattened to dotted keys.

    As shown (retrain.housekeeping.secrets): an environment variable's value and a secret never enter it, so
    rotating a key never makes a run dir refuse its own run.
    """
    container = shown_config(cfg)
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            flat[prefix] = node

    # back-pressure changes the batch sizes, so it is part of a run's identity, but only when it is on
    skipped = NOT_IDENTITY if OmegaConf.select(cfg, "backpressure.enabled") else NOT_IDENTITY | {"backpressure"}
    walk({k: v for k, v in container.items() if k not in skipped}, "")
    return {k: v for k, v in flat.items() if k.partition(".")[2] not in NOT_IDENTITY_KEYS.get(k.partition(".")[0], ())}


def checkpoint_files(backend_cls: type) -> tuple[str, ...]:
    """The files the backend's `load` reads from a checkpoint (a plugin that declares none: only the trainer's state)."""
    return tuple(getattr(backend_cls, "checkpoint_files", ()))


def find_resume_checkpoint(cfg: DictConfig, run_dir: Path, required: tuple[str, ...]) -> Path | None:
    """This run dir's own latest checkpoint that reads whole, else `resume.from` (a run dir or a checkpoint dir).

    The first is what makes a requeued cluster job continue where it was killed: `resume.from` only seeds
    a new run, so re-entering a run dir that has a checkpoint of its own never starts over from the source.
    Damaged newer checkpoints are skipped (this run dir's own are set aside, another run's left as they are);
    when none of this run dir's own reads, `resume.from` is the way out, else the run fails (in status.json too).
    """
    source = str(cfg.resume["from"] or "")
    files = RunDir(run_dir)
    try:
        own = files.resumable_checkpoint(set_aside=True, required=required)
    except CheckpointError as error:
        if not source:
            files.record_failure(f"{type(error).__name__}: {error}")
            raise
        log.warning("%s; resuming from resume.from=%s instead", error, source)
        own = None
    if own is not None:
        return own.path
    if source:
        path = Path(source).expanduser()
        if Checkpoint(path).is_complete:
            if (damage := Checkpoint(path).damage(required)) is not None:
                raise CheckpointError(f"resume.from={source!r}: checkpoint {path} is damaged ({damage})")
            return path
        found = RunDir(path).resumable_checkpoint(set_aside=False, required=required) if path.is_dir() else None
        if found is None:
            raise ConfigError(f"resume.from={source!r}: no checkpoint ({STATE_FILE}) found there")
        return found.path
    return None


def resolve_seed(configured: int, resume: Path | None) -> int:
    """A resumed run keeps its seed; seed -1 draws one (and the checkpoint records it)."""
    if resume is not None:
        return int(Checkpoint(resume).state()["seed"])
    if configured >= 0:
        return configured
    seed = secrets.randbelow(2**31)
    log.info("training.seed=-1: drew seed %d", seed)
    return seed
