"""The data-source contract and the shuffled, resumable cursor every built-in source uses."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from retrain.types import Example


@runtime_checkable
class DataSource(Protocol):
    """Deterministic order for a seed; the cursor is part of the checkpoint."""

    def __len__(self) -> int: ...

    def next_batch(self, batch_size: int) -> list[Example]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShuffledExamples:
    """Examples served in a seeded permutation, reshuffled each epoch; cursor = (epoch, position).

    The permutation of epoch e is drawn from `seed + e`, so a restored cursor reproduces the exact
    same order without storing the permutation.
    """

    def __init__(self, examples: list[Example], seed: int) -> None:
        if not examples:
            raise ValueError("data source is empty: no examples were loaded")
        self.examples = examples
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        import torch  # here, not at module level: the config schemas import this module, and --help should be quick

        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.examples)

    def next_batch(self, batch_size: int) -> list[Example]:
        batch: list[Example] = []
        while len(batch) < batch_size:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            batch.append(self.examples[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)
