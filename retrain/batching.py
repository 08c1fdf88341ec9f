"""How many prompts each step samples: the batching part owns the batch size and its state.

The trainer asks `batch_size()` before every step and reports every finished step's record to
`observe`, so a controller that adapts the size to measured throughput (back-pressure) plugs in
here without touching the loop. Its state is saved in every checkpoint, so a resumed run continues
with the size it had reached.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from retrain.errors import ConfigError

log = logging.getLogger(__name__)


@runtime_checkable
class Batching(Protocol):
    """Chooses each step's batch size (prompts per step) from what past steps measured."""

    def batch_size(self) -> int:
        """Prompts for the next step."""

    def observe(self, record: Mapping[str, Any]) -> None:
        """Learn from a finished step's metrics record (its timings, tokens, ...)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state, saved in every checkpoint."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's state."""


class FixedBatching:
    """`training.batch_size` prompts every step."""

    def __init__(self, batch_size: int) -> None:
        if batch_size < 1:
            raise ConfigError(f"training.batch_size must be >= 1, got {batch_size}")
        self.size = batch_size

    def batch_size(self) -> int:
        return self.size

    def observe(self, record: Mapping[str, Any]) -> None:
        """A fixed size learns nothing from a step."""

    def state_dict(self) -> dict[str, Any]:
        return {"batch_size": self.size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The configured size stands: a run resumed with `resume.from` and a new batch size uses it."""
        saved = int(state["batch_size"])
        if saved != self.size:
            log.info("training.batch_size is %d; the checkpoint's run used %d", self.size, saved)
