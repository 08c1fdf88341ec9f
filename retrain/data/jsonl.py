"""`data=jsonl`: any record file or Hub data set, with configurable field names.

Also home of what every file-backed source shares: `load_records`, one code path (through
`datasets.load_dataset`) for Hub ids, local directories and local files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import datasets

from retrain.data.base import ExampleData, fixed_subset
from retrain.data.config import JsonlDataConfig
from retrain.data.prompts import check_template, fill_template
from retrain.data.records import InvalidRows, SplitRecords, file_problem, split_files
from retrain.errors import ConfigError, DataError, UserError
from retrain.hub import hub_fetch, local_path
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Example

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


# ---- loading ------------------------------------------------------------------------------
def load_records(
    path: str, split: str, config_name: str | None = None, setting: str = "data.path", split_setting: str = "data.split"
) -> datasets.Dataset:
    """One split of a Hub data set, a local data set directory, or a local file.

    A directory is read the way the Hub is (its README's configs, else splits named by file:
    train.jsonl, test.jsonl, ...); a single file is one split called "train". `config_name` picks
    a Hub config such as gsm8k's "main" and is ignored by data sets that declare no configs, so a
    local copy works with the same settings as the Hub id.
    """
    local = local_path(path, setting)
    if local is not None and local.exists() and not local.is_file() and not local.is_dir():
        raise ConfigError(
            f"{setting}={path!r} is not a regular file (a FIFO, socket or device such as /dev/null); give a "
            "jsonl/json/parquet/csv file, a data set directory or a Hub id"
        )
    if local is not None and local.is_file():
        builder = FILE_BUILDERS.get(local.suffix.lower())
        if builder is None:
            raise ConfigError(
                f"{setting}={path!r}: unsupported file type {local.suffix!r} (use one of {', '.join(FILE_BUILDERS)})"
            )
        with _readable(path, setting, local, split, None):
            return _load(
                builder,
                None,
                split,
                {"data_files": {"train": str(local)}},
                split_setting,
                f"{path} is a single file, which is one split named 'train'",
            )
    source = str(local) if local is not None else path
    with _fetching(path, local, setting), _readable(path, setting, local, split, config_name):
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


@contextmanager
def _readable(path: str, setting: str, local: Path | None, split: str, config_name: str | None) -> Iterator[None]:
    """A malformed record or an unreadable file: a DataError naming the setting, and the file and line
    when a local file of the split shows the cause (an empty file, a malformed line, non-UTF-8 bytes)."""
    try:
        with _datasets_logging_into_log_files():
            yield
    except UserError:
        raise
    except Exception as exc:  # datasets says StopIteration, ValueError, UnicodeDecodeError, ArrowInvalid, ...
        problem = next(filter(None, map(file_problem, split_files(local, split, config_name))), None)
        if problem is not None:
            raise DataError(f"{setting}={path!r}: cannot read the records: {problem}") from exc
        if isinstance(exc, datasets.exceptions.DatasetGenerationError):
            raise DataError(f"{setting}={path!r}: cannot read the records ({exc.__cause__ or exc})") from exc
        if local is not None:  # a local file or directory: whatever `datasets` says is about the data
            kind = "directory" if local.is_dir() else "file"
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise DataError(f"{setting}={path!r}: cannot read the records of this {kind} ({reason})") from exc
        raise


@contextmanager
def _datasets_logging_into_log_files() -> Iterator[None]:
    """In a run (its run.log open), what `datasets` logs while loading goes to the log files only: its
    parse errors reached the console twice (its own stderr handler, then the root logger's) ahead of
    retrain's one line naming the file and line. Outside a run, nothing changes."""
    files = [handler for handler in logging.getLogger().handlers if isinstance(handler, logging.FileHandler)]
    library = logging.getLogger("datasets")
    saved = library.handlers[:], library.propagate
    if files:
        library.handlers[:], library.propagate = files, False
    try:
        yield
    finally:
        library.handlers[:], library.propagate = saved


def _pick_config(source: str, config_name: str | None, setting: str) -> str | None:
    if not config_name:
        return None
    available = datasets.get_dataset_config_names(source)
    if config_name in available:
        return config_name
    if available == ["default"]:
        return None
    raise ConfigError(f"{setting}={source!r} has no config {config_name!r}; it has {available}")


def _load(
    source: str, name: str | None, split: str, kwargs: dict[str, Any], split_setting: str, where: str
) -> datasets.Dataset:
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


# ---- the generic source ---------------------------------------------------------------------
@built_in
@takes_settings(JsonlDataConfig)
class JsonlData(ExampleData):
    """Prompts and references from any jsonl/json/parquet/csv file, data set directory or Hub id."""

    def __init__(self, config: JsonlDataConfig, seed: int) -> None:
        if not config.path:
            raise ConfigError(
                "data=jsonl needs data.path: a jsonl/json/parquet/csv file, a data set directory or a Hub id"
            )
        check_template(config.prompt_template, {"question"}, "data.prompt_template")
        extra_names = [str(name) for name in config.extra_fields]
        fields = {
            "data.question_field": config.question_field,
            "data.answer_field": config.answer_field,
            **({"data.id_field": config.id_field} if config.id_field else {}),
            **{f"data.extra_fields[{i}]": name for i, name in enumerate(extra_names)},
        }

        def load(which: str, split_setting: str) -> list[Example]:
            dataset = load_records(config.path, which, config.config_name or None, split_setting=split_setting)
            require_fields(dataset, fields, f"{config.path} ({which})")
            records = SplitRecords(config.path, which, config.config_name or None)
            invalid = InvalidRows("jsonl", records, config.skip_invalid)
            examples = [
                Example(
                    prompt=fill_template(config.prompt_template, question=str(record[config.question_field])),
                    reference=str(record[config.answer_field]).strip(),
                    id=str(record[config.id_field]) if config.id_field else f"{which}/{index}",
                    extra={
                        "question": str(record[config.question_field]),
                        **{name: record[name] for name in extra_names},
                    },
                )
                for index, record in records.enumerate(dataset)
                if not invalid.rejects_blank(index, record, (config.question_field, config.answer_field))
            ]
            invalid.report()
            return examples

        super().__init__(
            name="jsonl",
            train=fixed_subset(load(config.split, "data.split"), config.max_examples),
            seed=seed,
            held_out=(lambda: load(config.held_out_split, "data.held_out_split")) if config.held_out_split else None,
        )
