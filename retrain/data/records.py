"""Naming a bad record by its file and line: unreadable files, and rows that cannot become an example.

`datasets` reports an empty file as StopIteration, a malformed line as a pyarrow parse error and
non-UTF-8 bytes as a UnicodeDecodeError, none naming the file; and a row whose question or answer
is null loads fine and becomes the text "None" (whose `\\boxed{None}` then scores 1). These helpers
find the file and line behind both, so the message says what to fix. They read the files again only
when something is wrong, so a good data set costs nothing extra.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import datasets

from retrain.errors import DataError
from retrain.hub import local_path

log = logging.getLogger(__name__)

SHOWN_SKIPS = 3  # skipped rows named in the warning; the rest are counted


def split_files(local: Path | None, split: str, config_name: str | None) -> list[Path]:
    """The local files `datasets` reads for `split`: the file itself, or a directory's files for that
    split; [] for a Hub id or when they cannot be resolved (the caller then names records by index)."""
    if local is None:
        return []
    if local.is_file():
        return [local]
    try:
        name = config_name if config_name in datasets.get_dataset_config_names(str(local)) else None
        builder = datasets.load_dataset_builder(str(local), name)
    except (OSError, ValueError, datasets.exceptions.DatasetsError):
        return []
    data_files = builder.config.data_files or {}
    return [Path(file) for split_name, files in data_files.items() if str(split_name) == split for file in files]


def file_problem(path: Path) -> str | None:
    """Why a record file cannot be read, naming the line of a text file (jsonl, json, csv); None when it reads."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return parquet_problem(path)
    if suffix not in {".jsonl", ".json", ".csv"}:
        return None
    lines: list[str] = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as error:
                return (
                    f"{path} line {number}: not UTF-8 text (byte {raw[error.start]:#04x} at column {error.start + 1})"
                )
    if not any(line.strip() for line in lines):
        return f"{path} is empty: it holds no records"
    if suffix == ".csv" or (suffix == ".json" and _is_one_json_document("".join(lines))):
        return None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as error:
            return f"{path} line {number}: malformed JSON ({error.msg} at column {error.colno})"
        if not isinstance(record, dict):
            return f"{path} line {number}: not a JSON object (got {type(record).__name__})"
    return None


def parquet_problem(path: Path) -> str | None:
    """Why a parquet file cannot be read (truncated, not parquet, no rows); None when it reads."""
    import pyarrow  # datasets' own dependency
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except (OSError, pyarrow.ArrowException) as error:
        return f"{path} is not a readable parquet file (truncated or damaged: {error})"
    return f"{path} is empty: it holds no records" if rows == 0 else None


def _is_one_json_document(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class SplitRecords:
    """One split of a data source, for naming its records: `<file> line N` when the split is read from
    local jsonl files, else `data.path=<path>, <split> record <index>`. Its files are looked at on
    first use only, that is when something is wrong."""

    def __init__(self, path: str, split: str, config_name: str | None = None) -> None:
        self.path = path
        self.split = split
        self.config_name = config_name

    def name(self, index: int) -> str:
        position = index
        for file, line_numbers in self._jsonl_lines:
            if position < len(line_numbers):
                return f"{file} line {line_numbers[position]}"
            position -= len(line_numbers)
        return f"data.path={self.path!r}, {self.split} record {index}"

    def enumerate(self, dataset: datasets.Dataset) -> Iterator[tuple[int, dict[str, Any]]]:
        """`enumerate(dataset)`; bytes that are not UTF-8 (`datasets` loads them and fails to decode
        them when a record is read) are a DataError naming the file and line."""
        try:
            yield from enumerate(dataset)
        except UnicodeDecodeError as error:
            problem = next(filter(None, map(file_problem, self._files)), None)
            raise DataError(f"data.path={self.path!r}: cannot read the records: {problem or error}") from error

    @cached_property
    def _files(self) -> list[Path]:
        return split_files(local_path(self.path, "data.path"), self.split, self.config_name)

    @cached_property
    def _jsonl_lines(self) -> list[tuple[Path, list[int]]]:
        """Per file of the split, the line number of each record (blank lines hold none); [] unless all are jsonl."""
        if not self._files or any(file.suffix.lower() != ".jsonl" for file in self._files):
            return []
        with_lines = []
        for file in self._files:
            with open(file, "rb") as handle:
                with_lines.append((file, [number for number, line in enumerate(handle, start=1) if line.strip()]))
        return with_lines


def is_blank(value: Any) -> bool:
    """A field that cannot be a question or a reference: missing (null) or only whitespace."""
    return value is None or (isinstance(value, str) and not value.strip())


class InvalidRows:
    """Rows of one split that cannot become an example: a DataError naming the first, or, with
    `data.skip_invalid=true`, skipped, counted and reported in one warning (`report`)."""

    def __init__(self, source: str, records: SplitRecords, skip: bool) -> None:
        self.source = source
        self.records = records
        self.skip = skip
        self.skipped: list[str] = []

    def reject(self, index: int, why: str) -> None:
        """Row `index` is unusable: raise, or (skip_invalid) remember it; the caller then drops the row."""
        where = f"{self.records.name(index)}: {why}"
        if not self.skip:
            raise DataError(f"{where}; fix or remove the row, or set data.skip_invalid=true to skip such rows")
        self.skipped.append(where)

    def rejects_blank(self, index: int, record: Mapping[str, Any], fields: Iterable[str]) -> bool:
        """Reject row `index` when one of `fields` is missing, null or blank; True when it was rejected
        (and so skipped)."""
        for name in fields:
            if is_blank(record.get(name)):
                self.reject(index, f"field {name!r} is missing, null or empty")
                return True
        return False

    def report(self) -> None:
        if not self.skipped:
            return
        shown = "; ".join(self.skipped[:SHOWN_SKIPS]) + ("; ..." if len(self.skipped) > SHOWN_SKIPS else "")
        log.warning(
            "data=%s: skipped %d invalid %s rows of %s (data.skip_invalid=true): %s",
            self.source,
            len(self.skipped),
            self.records.split,
            self.records.path,
            shown,
        )
