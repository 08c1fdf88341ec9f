"""How many prompts each step samples: the batching part owns the batch size and its state.

The trainer asks `batch_size(step)` before every step and reports every finished step's record to
`observe`, whose metrics join that record, so the controller that adapts the size to measured
throughput (back-pressure, retrain/training/backpressure.py) plugs in here without touching the loop. Its
state is saved in every checkpoint, so a resumed run continues with the size it had reached.
`batch_size` changes nothing: in split mode the next step's size is asked for before this step is observed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from retrain.config import BackpressureConfig
from retrain.training.backpressure import BackpressureController, Roofline, model_footprint

log = logging.getLogger(__name__)


@runtime_checkable
class Batching(Protocol):
    """Chooses each step's batch size (prompts per step) from what past steps measured."""

    def batch_size(self, step: int) -> int:
        """Prompts for step `step` (0-based)."""

    def observe(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Learn from a finished step's metrics record (its timings, tokens, ...); returns metrics to add to it."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state, saved in every checkpoint."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's state."""


class FixedBatching:
    """`training.batch_size` prompts every step."""

    def __init__(self, batch_size: int) -> None:
        self.size = batch_size  # >= 1: checked with the config (retrain/config_checks/validation.py)

    def batch_size(self, step: int) -> int:
        return self.size

    def observe(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """A fixed size learns nothing from a step."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The configured size stands: a run resumed with `resume.from` and a new batch size uses it."""
        saved = int(state["batch_size"])
        if saved != self.size:
            log.info("training.batch_size is %d; the checkpoint's run used %d", self.size, saved)


def build_batching(settings: BackpressureConfig, batch_size: int, group_size: int, model: Any | None) -> Batching:
    """The back-pressure controller when `backpressure.enabled`, else `batch_size` prompts every step.

    `model` is the live policy model when the backend holds one (its size feeds the roofline hint);
    None for a remote backend, whose run then gets no roofline hint.
    """
    if not settings.enabled:
        return FixedBatching(batch_size)
    roofline = None
    if settings.peak_gflops > 0 or settings.peak_bw_gb_s > 0:
        if model is None:
            log.info("backpressure: no local model to count parameters of; no roofline hint")
        else:
            parameters, parameter_bytes = model_footprint(model)
            roofline = Roofline(settings.peak_gflops, settings.peak_bw_gb_s, parameters, parameter_bytes)
    return BackpressureController(settings, batch_size, group_size, roofline)
