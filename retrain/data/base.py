"""The data-source contract and what every built-in source shares: the shuffled, resumable cursor
(`ShuffledExamples`), the training/held-out server built on it (`ExampleData`), and the seed-independent
choices of which examples to keep and in which order to hold them out."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from retrain.errors import ConfigError
from retrain.types import Example

SUBSET_SEED = 0  # fixes which examples max_examples keeps and the held-out order, for every seed


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


class ExampleData:
    """Training examples in a seeded, resumable order, and a held-out set loaded on first use.

    `held_out(n)` gives the first n held-out examples: the same problems for every training seed. A
    loaded split is held out in a fixed shuffled order (a mix of the whole split rather than its head);
    a source whose held-out set is already in a seed-independent random order passes
    `shuffle_held_out=False`. `held_out_setting` is the key that sizes the held-out set, named in errors.
    """

    def __init__(
        self,
        name: str,
        train: list[Example],
        seed: int,
        held_out: Callable[[], list[Example]] | None,
        shuffle_held_out: bool = True,
        held_out_setting: str = "data.held_out_split",
    ) -> None:
        if not train:
            raise ConfigError(f"data={name} loaded no training examples (check its path, split and filters)")
        self.name = name
        self._train = ShuffledExamples(train, seed)
        self._load_held_out = held_out
        self._shuffle_held_out = shuffle_held_out
        self._held_out_setting = held_out_setting
        self._held_out: list[Example] | None = None

    def __len__(self) -> int:
        return len(self._train)

    @property
    def train_examples(self) -> list[Example]:
        """All training examples in load order (the order next_batch serves depends on the seed)."""
        return self._train.examples

    def next_batch(self, batch_size: int) -> list[Example]:
        return self._train.next_batch(batch_size)

    def held_out(self, n: int) -> list[Example]:
        if self._load_held_out is None:
            raise ConfigError(
                f"data={self.name} has no held-out split: set data.held_out_split (e.g. test) to a split of data.path"
            )
        if self._held_out is None:
            loaded = self._load_held_out()
            self._held_out = fixed_order(loaded) if self._shuffle_held_out else loaded
        if not 0 <= n <= len(self._held_out):
            raise ConfigError(
                f"held_out({n}) asks for more than the {len(self._held_out)} held-out "
                f"examples of data={self.name} (see {self._held_out_setting})"
            )
        return self._held_out[:n]

    def state_dict(self) -> dict[str, Any]:
        return {**self._train.state_dict(), "num_examples": len(self._train)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("num_examples", len(self._train))
        if saved != len(self._train):
            raise ConfigError(
                f"the checkpoint's data cursor is for {saved} examples but data={self.name} "
                f"now has {len(self._train)}: resume with the data settings of the run"
            )
        self._train.load_state_dict(state)


def fixed_subset(items: list[Any], limit: int) -> list[Any]:
    """At most `limit` items (0 = all), spread over the whole list, the same for every seed."""
    if limit <= 0 or limit >= len(items):
        return items
    keep = sorted(random.Random(SUBSET_SEED).sample(range(len(items)), limit))
    return [items[i] for i in keep]


def fixed_order(items: list[Any]) -> list[Any]:
    """`items` in one shuffled order that does not depend on the training seed."""
    shuffled = list(items)
    random.Random(SUBSET_SEED).shuffle(shuffled)
    return shuffled
