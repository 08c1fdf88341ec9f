"""The inference-engine contract: how the trainer gets completions and keeps the sampler's weights current.

An engine samples beside a training backend: it is built from the run's tokenizer and what the
backend offers it (`EngineResources`: the model spec, the device, and the live training model for
an in-process engine). After every optimizer step the trainer calls `sync(update)` and then proves
the sync with a log-prob probe (retrain.training.freshness). A backend that samples itself (a
remote service) is its own engine: it implements this protocol and declares
`Capabilities(samples_itself=True)`.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from retrain.model.probe import check_probe_logprobs
from retrain.plugins import Check, PluginOutputError, check_shape
from retrain.types import Rollouts, SamplingParams, WeightUpdate

if TYPE_CHECKING:
    from retrain.model.probe import Probe


log = logging.getLogger("retrain")


class NucleusLogprobsWarning:
    """Warns once when a sampler's log-probs are those after top-p: with top_p < 1 they are the
    renormalised nucleus's, above the trainer's full-distribution ones by -log(nucleus mass)."""

    def __init__(self, sampler: str) -> None:
        self.sampler = sampler
        self.warned = False

    def check(self, sampling: SamplingParams) -> None:
        if sampling.top_p < 1 and sampling.temperature > 0 and not self.warned:
            self.warned = True
            log.warning(
                "training.top_p=%s: %s reports log-probs of the renormalised nucleus, above the trainer's "
                "full-distribution ones by -log(nucleus mass), so policy/ratio_mean sits below 1 at the first "
                "update; use top_p=1 for exact ratios",
                sampling.top_p,
                self.sampler,
            )


class SamplingInterrupted(Exception):
    """A stop request cancelled sampling in flight (an engine's optional `interrupt()`): the step is
    dropped and the run checkpoints the steps it finished (retrain.training.trainer)."""


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples B×G completions with the policy's current weights."""

    returns_entropies: bool  # whether `generate` can fill Rollouts.entropies
    weights_version: int  # the optimizer step whose weights `generate` samples with (0 = the initial adapter)
    # Optional: an engine serving in a coarser precision than the trainer sets `probe_tolerance` (see
    # retrain.training.freshness.probe_tolerance); the freshness proof then allows the looser of it and the backend's.
    # Optional: `interrupt()` cancels a `generate` in flight from a signal handler or another thread, which then
    # raises SamplingInterrupted (the server engines do): a stop request then never waits on a stuck request.
    # Optional: `own_device = True` says the engine samples on devices of its own, never with the trainer's weights
    # as they change (the server engines): the trainer may then sample ahead (training.max_staleness, docs/async.md).
    # Optional, for the loopback endpoint's concurrent requests (retrain.inference.request_batcher): an engine in this
    # process samples them in one continuous batch with `generate_requests(requests, on_done, more)` (pytorch, vllm);
    # one that samples on servers takes each on its caller's thread, all at once, with
    # `generate_request(request, arrival)` (the server engines). A plugin engine with neither gets one at a time.

    def generate(
        self, prompt_ids: list[list[int]], group_size: int, sampling: SamplingParams, generator_seed: int | None
    ) -> Rollouts:
        """Sample `group_size` completions per prompt; rows are group-major (n = b·G + g).
        The same `generator_seed` gives the same rollouts on the same device and weights. An engine that also takes
        `row_offset` (the global index of the call's first row, a multiple of G) can sample a data-parallel rank's
        share of a batch (docs/distributed.md): every built-in engine does, sampling each row as the whole batch
        would (pytorch by global row id, the others by seeding prompt row_offset // G + i as the batch's prompt);
        a run on several ranks refuses an engine that does not."""

    def sync(self, update: WeightUpdate) -> None:
        """Serve the weights of `update` from now on (StaleWeightsError for a version older than
        the one served)."""

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """[K] log-probs at T = 1 of the probe's completion tokens, through the engine's own
        sampling path (what the freshness proof compares with the trainer's)."""

    def close(self) -> None:
        """Release what the engine holds (servers, caches)."""


@runtime_checkable
class ServesVersions(Protocol):
    """An engine that can serve several weights versions at once (the server engines' adapters): sampling ahead, each
    batch names the version it is pinned to while newer ones load (retrain.training.producer, docs/async.md)."""

    serves_versions: bool  # False: this instance serves one version after all (no adapters)

    def keep_versions_from(self, version: int) -> None:
        """Keep the versions from `version` on loaded when the next ones load."""

    def sampling_version(self, version: int) -> AbstractContextManager[None]:
        """Sampling requests name weights version `version` meanwhile."""


def check_rollouts(rollouts: Any, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Rollouts:
    """The contract of `generate`: consistent padded tensors for B prompts × G completions."""
    prompt_ids, group_size = args[0], args[1]
    if not isinstance(rollouts, Rollouts):
        raise PluginOutputError(f"{what}.generate returned {type(rollouts).__name__}, expected Rollouts")
    rows = len(prompt_ids) * group_size
    if rollouts.group_size != group_size or rollouts.batch_size != len(prompt_ids):
        raise PluginOutputError(
            f"{what}.generate returned {rollouts.batch_size} prompts × group size "
            f"{rollouts.group_size}, expected {len(prompt_ids)} × {group_size}"
        )
    width = rollouts.completion_ids.shape[-1]
    shape = (rows, width)
    for name in ("completion_mask", "completion_ids"):
        if tuple(getattr(rollouts, name).shape) != shape:
            raise PluginOutputError(
                f"{what}.generate returned {name} of shape "
                f"{list(getattr(rollouts, name).shape)}, expected {list(shape)}"
            )
    mask = rollouts.completion_mask.bool()
    for name in ("logprobs", "entropies"):
        value = getattr(rollouts, name)
        if value is not None and not bool(
            torch.isfinite(check_shape(value, shape, what=f"{what}.generate ({name})")[mask]).all()
        ):
            raise PluginOutputError(f"{what}.generate returned non-finite {name} on completion tokens")
    if len(rollouts.texts) != rows or tuple(rollouts.hit_max_tokens.shape) != (rows,):
        raise PluginOutputError(
            f"{what}.generate returned {len(rollouts.texts)} texts and hit_max_tokens of "
            f"shape {list(rollouts.hit_max_tokens.shape)}, expected {rows} of each"
        )
    return rollouts


ENGINE_CHECKS: dict[str, Check] = {"generate": check_rollouts, "probe_logprobs": check_probe_logprobs}
