"""Checks that need no model weights, run by the composition root before any model loads.

Without them a wrong value surfaces after gigabytes of weights have loaded, as a traceback deep in
an engine (a negative group size), or never (a NaN learning rate passes `lr > 0` and trains
nothing), and a prompt longer than the model's context is sampled past the positions the model
knows. Each check names the key, or the data row, to fix, and the config's checks report every
wrong value in one message: a run refused for one key and then for the next costs a launch each.

Importing this module imports neither torch nor transformers (what needs them imports them where it is
used): the CLI runs `check_run_config` before it imports the run, so a wrong value or a missing file is
refused in a second or two, not after the 10-20 s those imports take on a busy machine.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig, check_known_keys
from retrain.config_checks.compose_errors import unresolvable
from retrain.data.config import LOCAL_OR_HUB_PATHS
from retrain.environments.config import AgentDataConfig
from retrain.errors import ConfigError, ConfigErrors, DataError, refuse_all
from retrain.housekeeping.console import PROGRESS_BAR_CHOICES
from retrain.housekeeping.secrets import check_env_names
from retrain.hub import hub_fetch, local_path
from retrain.model.config_files import read_config_file
from retrain.model.spec import ChatPrompts, ModelSpec

if TYPE_CHECKING:
    from retrain.algorithm.base import Algorithm
    from retrain.types import Example

log = logging.getLogger("retrain")

SEED_MAX = 2**32 - 1  # the widest seed every generator a run seeds (numpy's too) takes
# run-wide values whose range no part checks before the model loads: key -> (valid?, what is valid)
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "training.seed": (lambda v: -1 <= v <= SEED_MAX, f"-1 (draw a seed) or in 0..{SEED_MAX}"),
    "training.batch_size": (lambda v: v >= 1, ">= 1"),
    "training.group_size": (lambda v: v >= 1, ">= 1"),
    "training.max_tokens": (lambda v: v >= 1, ">= 1"),
    "training.temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "training.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "eval.num_examples": (lambda v: v >= 0, ">= 0 (0 = no evaluation)"),
    "eval.samples": (lambda v: v >= 1, ">= 1"),
    "eval.every": (lambda v: v >= 0, ">= 0 (0 = before and after training only)"),
    "training.save_every": (lambda v: v >= 0, ">= 0 (0 = only at the end)"),
    "training.threads": (lambda v: v >= 0, ">= 0 (0 = the CPUs this process may use)"),
    "logging.progress_bar": (lambda v: str(v).strip().lower() in PROGRESS_BAR_CHOICES, "auto, true or false"),
}
SELF_CHECKED = ("model", "scoring", "inference", "reward", "data")  # each part's schema checks its own values
PROMPT_CHUNK = 1024  # prompts templated and tokenized per call when their lengths are checked
PROBE_TOKENS = 4  # tokens per completion of the synthetic step that tells whether an algorithm can learn


def check_run_config(cfg: DictConfig) -> None:
    """Every check a run makes on its config before it builds anything (`python -m retrain` and `retrain explain`
    both run these): no unknown key, every value in range, no secret written inline where an env name belongs, and
    no local path of the model or the data that does not exist."""
    check_known_keys(cfg)
    check_config(cfg)
    check_env_names(cfg)
    check_local_paths(cfg)


def check_local_paths(cfg: DictConfig) -> None:
    """ConfigError naming `model.name_or_path`, `data.path` or `data.tasks` when it looks like a local path (absolute, relative, a
    data file's name) and does not exist (retrain.hub.local_path); a Hub id is looked up where it loads, as before.
    Only the built-in schemas': a plugin's `path` may mean anything."""
    model = OmegaConf.to_object(cfg.model)
    if isinstance(model, ModelSpec):
        model.source()  # a local directory: it exists and holds a config.json
    data = OmegaConf.to_object(cfg.data)
    if isinstance(data, LOCAL_OR_HUB_PATHS) and data.path:
        local_path(data.path, "data.path")
    if isinstance(data, AgentDataConfig):
        local_path(data.tasks, "data.tasks")


def check_config(cfg: DictConfig) -> None:
    """ConfigError naming the key of every value that cannot work, all in one message: a float that
    is not finite (anywhere, plugin arguments included), a squeeze setting, a run-wide value out of
    its range, or a model, scoring, inference, reward or data value its schema refuses. An interpolation that does
    not resolve is refused first and alone: the other checks read the values it feeds."""
    check_resolvable(cfg)
    refuse_all(config_problems(cfg))


def config_problems(cfg: DictConfig) -> list[str]:
    """One message per wrong key of a resolvable `cfg`, each key named once (by its first check)."""
    problems = list(nonfinite_values(cfg))
    if cfg.get("squeeze") is not None:  # a campaign's block (its driver checks it first); its module imports torch
        from retrain.campaign.autosqueeze import squeeze_settings

        problems += _refusals(lambda: squeeze_settings(cfg))
    for key, (valid, rule) in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if not valid(value):
            problems.append(f"{key} must be {rule}, got {value}")
    if cfg.eval.every > 0 and cfg.eval.num_examples == 0:
        problems.append(f"eval.every={cfg.eval.every} needs held-out problems: set eval.num_examples > 0")
    problems += _refusals(functools.partial(_check_settings, cfg))
    for section in SELF_CHECKED:  # their schemas check their values when built: now, not after data or a model loads
        problems += _refusals(functools.partial(OmegaConf.to_object, cfg[section]))
    first_per_key = {_key_of(problem): problem for problem in reversed(problems)}  # `lr=-inf`: not finite, not > 0
    return [problem for problem in problems if first_per_key[_key_of(problem)] is problem]


def _check_settings(cfg: DictConfig) -> None:
    """The optimiser's and the loss's own checks, now rather than after the tokenizer has loaded."""
    training: TrainingConfig = OmegaConf.to_object(cfg.training)  # type: ignore[assignment]
    optim = _refusals(functools.partial(OptimSettings.from_config, training))
    refuse_all(optim + _refusals(functools.partial(LossSettings.from_config, training)))


def _refusals(check: Callable[[], object]) -> list[str]:
    """The problems of the ConfigError `check` raises (one per key it names), none when it passes."""
    try:
        check()
    except ConfigErrors as errors:
        return errors.problems
    except ConfigError as error:
        return [str(error)]
    return []


def _key_of(problem: str) -> str:
    """The key a problem names first: `training.lr must be > 0, got -1.0` -> `training.lr`."""
    return problem.split(" ", 1)[0].split("=", 1)[0]


def check_resolvable(cfg: DictConfig) -> None:
    """ConfigError naming the key whose interpolation cannot resolve (`${oc.env:TOKEN}`, TOKEN unset),
    now rather than when a part reads it after the model has loaded."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as error:
        raise ConfigError(unresolvable(error)) from error


def nonfinite_values(node: DictConfig | ListConfig, prefix: str = "") -> Iterator[str]:
    """A message for each float under `node` that is NaN or infinite (`training.lr=nan`), naming its key."""
    keys: Sequence[Any] = range(len(node)) if isinstance(node, ListConfig) else list(node.keys())
    for key in keys:
        if OmegaConf.is_interpolation(node, key):
            continue  # checked where it points to, under the key the user set
        where = f"{prefix}[{key}]" if isinstance(node, ListConfig) else f"{prefix}.{key}" if prefix else str(key)
        try:
            value = node[key]
        except OmegaConfBaseException:
            continue  # a value that cannot be read here (a missing ???) fails where it is used
        if isinstance(value, (DictConfig, ListConfig)):
            yield from nonfinite_values(value, where)
        elif isinstance(value, float) and not math.isfinite(value):
            yield f"{where}={value} is not a finite number"


def warn_if_untrainable(algorithm: Algorithm, training: TrainingConfig) -> None:
    """Warn, once at start, when the sampling settings make every group's rewards equal and the
    algorithm then gives every completion advantage 0: a run that can never train.

    `group_size=1` leaves one completion per group, `temperature=0` samples a group's completions
    greedily, all alike. Whether the algorithm learns nothing from such groups is observed on a
    synthetic step, so a user's advantage that is not group-relative draws no warning.
    """
    size = training.group_size
    if size == 1:
        cause, fix = "training.group_size=1 leaves one completion per group", "training.group_size >= 2"
    elif training.temperature == 0:
        cause, fix = "training.temperature=0 samples every completion of a group alike", "training.temperature > 0"
    else:
        return
    if _learns_from_uniform_groups(algorithm, size):
        return
    log.warning(
        "%s, so algorithm %r, whose advantages compare the completions of a group, gives every completion "
        "advantage 0: this run can never train; set %s",
        cause,
        getattr(algorithm, "name", type(algorithm).__name__),
        fix,
    )


def _learns_from_uniform_groups(algorithm: Algorithm, group_size: int) -> bool:
    """Whether `algorithm` gives any token a nonzero advantage when each group's rewards are equal."""
    import torch

    rewards = torch.tensor([[1.0] * group_size, [0.0] * group_size])
    rows = rewards.numel()
    probe = copy.deepcopy(algorithm)  # the real algorithm's schedule state stays untouched
    probe.begin_step(0)
    output = probe.compute(
        rewards=rewards,
        logprobs=torch.full((rows, PROBE_TOKENS), -1.0),
        mask=torch.ones(rows, PROBE_TOKENS, dtype=torch.bool),
        entropies=torch.ones(rows, PROBE_TOKENS) if algorithm.needs_entropies else None,
        planning=torch.zeros(rows, PROBE_TOKENS, dtype=torch.bool) if algorithm.needs_planning else None,
    )
    return bool(output.token_advantages.abs().sum() > 0)


def model_context(model: ModelSpec) -> int | None:
    """The model's context in tokens, `max_position_embeddings` of its config.json (read without loading
    weights; a multimodal config's `text_config` counts); None when the config declares none."""
    path, from_hub = model.source()
    if from_hub:
        from huggingface_hub import hf_hub_download

        with hub_fetch(model.name_or_path, "model", "model.name_or_path"):
            config_file = Path(hf_hub_download(path, "config.json", revision=model.revision))
    else:
        config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = read_config_file(config_file)
    value = (config.get("text_config") or {}).get("max_position_embeddings") or config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def check_prompt_lengths(examples: Sequence[Example], tokenizer: Any, model: ModelSpec, max_tokens: int) -> None:
    """Refuse prompts that, chat-templated as the run sends them, leave less than `training.max_tokens`
    of the model's context, naming the first such data row. The encodings are dropped chunk by chunk
    (the run encodes the prompts it serves again), so a large data set costs time here, not memory."""
    context = model_context(model)
    if context is None:
        return
    room = context - max_tokens
    where = f"model.name_or_path={model.name_or_path!r} has a context of {context} tokens (max_position_embeddings)"
    if room <= 0:
        raise ConfigError(f"training.max_tokens={max_tokens} leaves no room for a prompt: {where}")
    too_long: list[tuple[Example, int]] = []
    for start in range(0, len(examples), PROMPT_CHUNK):
        chunk = examples[start : start + PROMPT_CHUNK]
        encoded = ChatPrompts(tokenizer, model.name_or_path)([example.prompt for example in chunk])
        too_long += [(example, len(ids)) for example, ids in zip(chunk, encoded) if len(ids) > room]
    if too_long:
        example, length = too_long[0]
        raise DataError(
            f"{len(too_long)} of {len(examples)} prompts do not fit: {where}, and training.max_tokens={max_tokens} "
            f"leaves {room} for the prompt, but data row {example.id!r} ({example.prompt[:60]!r}...) takes "
            f"{length} tokens; drop or shorten such rows, lower training.max_tokens or use a model with a longer context"
        )
