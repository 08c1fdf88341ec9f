"""`data=jsonl`: any record file or Hub data set, with configurable field names.

Also home of what every file-backed source shares: `load_records` (one code path, through
`datasets.load_dataset`, for Hub ids, local directories and local files) and `ExampleData` (a
seeded, resumable training order plus a held-out set loaded on demand).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import datasets

from retrain.data.base import ShuffledExamples
from retrain.data.prompts import DEFAULT_PROMPT_TEMPLATE, check_template, fill_template
from retrain.errors import ConfigError
from retrain.hub import hub_fetch, local_path
from retrain.types import Example

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
SUBSET_SEED = 0  # fixes which examples max_examples keeps and the held-out order, for every seed


# ---- loading ------------------------------------------------------------------------------
def load_records(path: str, split: str, config_name: str | None = None, setting: str = "data.path",
                 split_setting: str = "data.split") -> datasets.Dataset:
    """One split of a Hub data set, a local data set directory, or a local file.

    A directory is read the way the Hub is (its README's configs, else splits named by file:
    train.jsonl, test.jsonl, ...); a single file is one split called "train". `config_name` picks
    a Hub config such as gsm8k's "main" and is ignored by data sets that declare no configs, so a
    local copy works with the same settings as the Hub id.
    """
    local = local_path(path, setting)
    if local is not None and local.is_file():
        builder = FILE_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise ConfigError(f"{setting}={path!r}: unsupported file type {local.suffix!r} "
                              f"(use one of {', '.join(FILE_BUILDERS)})")
        return _load(builder, None, split, {"data_files": {"train": str(local)}}, split_setting,
                     f"{path} is a single file, which is one split named 'train'")
    source = str(local) if local is not None else path
    with _fetching(path, local, setting):
        name = _pick_config(source, config_name, setting)
        return _load(source, name, split, {}, split_setting, f"in {path}")


def config_names(path: str, setting: str = "data.path") -> list[str]:
    """The configs a data set declares (["default"] when it declares none)."""
    local = local_path(path, setting)
    if local is not None and local.is_file():
        return ["default"]
    with _fetching(path, local, setting):
        return datasets.get_dataset_config_names(str(local) if local is not None else path)


def _fetching(path: str, local: Path | None, setting: str) -> AbstractContextManager[None]:
    return nullcontext() if local is not None else hub_fetch(path, "dataset", setting)


def _pick_config(source: str, config_name: str | None, setting: str) -> str | None:
    if not config_name:
        return None
    available = datasets.get_dataset_config_names(source)
    if config_name in available:
        return config_name
    if available == ["default"]:
        return None
    raise ConfigError(f"{setting}={source!r} has no config {config_name!r}; it has {available}")


def _load(source: str, name: str | None, split: str, kwargs: dict[str, Any], split_setting: str,
          where: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(source, name, split=split, **kwargs)
    except ValueError as exc:
        if str(exc).startswith("Unknown split"):
            raise ConfigError(f"{split_setting}={split!r}: {exc} ({where})") from exc
        raise


def require_fields(dataset: datasets.Dataset, fields: dict[str, str], source: str) -> None:
    """ConfigError naming the setting of every configured field the records lack."""
    missing = {setting: name for setting, name in fields.items() if name not in dataset.column_names}
    if missing:
        wrong = ", ".join(f"{setting}={name!r}" for setting, name in missing.items())
        raise ConfigError(f"{wrong}: no such field in {source} (fields: {dataset.column_names})")


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


# ---- serving ------------------------------------------------------------------------------
class ExampleData:
    """Training examples in a seeded, resumable order, and a held-out set loaded on first use.

    `held_out(n)` gives the first n examples of the held-out split in a fixed shuffled order: the
    same problems for every training seed, and a mix of the whole split rather than its head.
    """

    def __init__(self, name: str, train: list[Example], seed: int,
                 held_out: Callable[[], list[Example]] | None) -> None:
        if not train:
            raise ConfigError(f"data={name} loaded no training examples (check its path, split and filters)")
        self.name = name
        self._train = ShuffledExamples(train, seed)
        self._load_held_out = held_out
        self._held_out: list[Example] | None = None

    def __len__(self) -> int:
        return len(self._train)

    @property
    def train_examples(self) -> list[Example]:
        return self._train.examples

    def next_batch(self, batch_size: int) -> list[Example]:
        return self._train.next_batch(batch_size)

    def held_out(self, n: int) -> list[Example]:
        if self._load_held_out is None:
            raise ConfigError(f"data={self.name} has no held-out split: set data.held_out_split "
                              f"(e.g. test) to a split of data.path")
        if self._held_out is None:
            self._held_out = fixed_order(self._load_held_out())
        if not 0 <= n <= len(self._held_out):
            raise ConfigError(f"held_out({n}) asks for more than the {len(self._held_out)} held-out "
                              f"examples of data={self.name}")
        return self._held_out[:n]

    def state_dict(self) -> dict[str, Any]:
        return {**self._train.state_dict(), "num_examples": len(self._train)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("num_examples", len(self._train))
        if saved != len(self._train):
            raise ConfigError(f"the checkpoint's data cursor is for {saved} examples but data={self.name} "
                              f"now has {len(self._train)}: resume with the data settings of the run")
        self._train.load_state_dict(state)


# ---- the generic source ---------------------------------------------------------------------
class JsonlData(ExampleData):
    """Prompts and references from any jsonl/json/parquet/csv file, data set directory or Hub id."""

    def __init__(self, seed: int, path: str, split: str = "train", held_out_split: str = "",
                 config_name: str = "", question_field: str = "question", answer_field: str = "answer",
                 id_field: str = "", extra_fields: Iterable[str] = (),
                 prompt_template: str = DEFAULT_PROMPT_TEMPLATE, max_examples: int = 0) -> None:
        if not path:
            raise ConfigError("data=jsonl needs data.path: a jsonl/json/parquet/csv file, a data set "
                              "directory or a Hub id")
        check_template(prompt_template, {"question"}, "data.prompt_template")
        extra_names = [str(name) for name in extra_fields]
        fields = {"data.question_field": question_field, "data.answer_field": answer_field,
                  **({"data.id_field": id_field} if id_field else {}),
                  **{f"data.extra_fields[{i}]": name for i, name in enumerate(extra_names)}}

        def load(which: str, split_setting: str) -> list[Example]:
            dataset = load_records(path, which, config_name or None, split_setting=split_setting)
            require_fields(dataset, fields, f"{path} ({which})")
            return [
                Example(prompt=fill_template(prompt_template, question=str(record[question_field])),
                        reference=str(record[answer_field]).strip(),
                        id=str(record[id_field]) if id_field else f"{which}/{index}",
                        extra={"question": str(record[question_field]),
                               **{name: record[name] for name in extra_names}})
                for index, record in enumerate(dataset)
            ]

        super().__init__(
            name="jsonl", train=fixed_subset(load(split, "data.split"), max_examples), seed=seed,
            held_out=(lambda: load(held_out_split, "data.held_out_split")) if held_out_split else None)
