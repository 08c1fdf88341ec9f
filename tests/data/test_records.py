"""Bad records are named by file and line: unreadable files, and rows with no question or answer."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest

from retrain.data.config import Gsm8kDataConfig, JsonlDataConfig, MathDataConfig
from retrain.data.gsm8k import Gsm8kData
from retrain.data.jsonl import JsonlData
from retrain.data.math import MathData
from retrain.errors import ConfigError, DataError

GOOD = b'{"question": "1+1", "answer": "2"}\n'


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"", "is empty: it holds no records"),
        (b"\n  \n", "is empty: it holds no records"),
        (GOOD + b'{"question": "2+2", "answer": \n' + GOOD, r"line 2: malformed JSON \(Expecting value at column 31\)"),
        (GOOD + b'{"question": "2+2", "answer": \n', "line 2: malformed JSON"),
        (GOOD + b'{"question": "2+2\xff", "answer": "4"}\n', r"line 2: not UTF-8 text \(byte 0xff at column 18\)"),
        (GOOD + b"\n" + b"{oops}\n", "line 3: malformed JSON"),
    ],
    ids=["empty", "blank lines", "malformed line", "torn last line", "not utf-8", "after a blank line"],
)
def test_an_unreadable_file_is_a_data_error_naming_file_and_line(tmp_path: Path, content: bytes, named: str) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"data.path='{path}': cannot read the records: {path} {named}"):
        JsonlData(JsonlDataConfig(path=str(path)), seed=0)


def parquet_bytes(rows: int) -> bytes:
    table = pyarrow.table({"question": ["1+1"] * rows, "answer": ["2"] * rows}, schema=PARQUET_SCHEMA)
    sink = io.BytesIO()
    pyarrow.parquet.write_table(table, sink)
    return sink.getvalue()


PARQUET_SCHEMA = pyarrow.schema([("question", pyarrow.string()), ("answer", pyarrow.string())])


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (parquet_bytes(0), "is empty: it holds no records"),
        (parquet_bytes(40)[:-200], r"is not a readable parquet file \(truncated or damaged: .*magic bytes"),
    ],
    ids=["empty", "truncated"],
)
def test_an_unreadable_parquet_file_is_a_data_error_naming_it(tmp_path: Path, content: bytes, named: str) -> None:
    path = tmp_path / "problems.parquet"
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"data.path='{path}': cannot read the records: {path} {named}"):
        JsonlData(JsonlDataConfig(path=str(path)), seed=0)


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "/dev/null"])
def test_a_fifo_or_a_device_is_refused_before_it_is_read(tmp_path: Path, special: str) -> None:
    path = Path(special)
    if special == "fifo":
        path = tmp_path / "problems.jsonl"
        os.mkfifo(path)  # reading it would block forever
    with pytest.raises(ConfigError, match=rf"data.path='{path}' is not a regular file \(a FIFO, socket or device"):
        JsonlData(JsonlDataConfig(path=str(path)), seed=0)


def test_a_directory_named_like_a_file_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.mkdir()
    with pytest.raises(DataError, match=rf"data.path='{path}': cannot read the records of this directory \(Empty"):
        JsonlData(JsonlDataConfig(path=str(path)), seed=0)


def test_in_a_run_datasets_own_parse_errors_go_to_run_log_only(tmp_path: Path) -> None:
    """retrain's DataError names the file and line; `datasets`' own lines stay off the console (its own
    stderr handler and the root logger's console handler, both stood in for by a StringIO here)."""
    path = tmp_path / "problems.jsonl"
    path.write_bytes(GOOD + b"{oops}\n")
    root, library = logging.getLogger(), logging.getLogger("datasets")
    console, own_stderr = io.StringIO(), io.StringIO()
    handlers = [
        (root, logging.FileHandler(tmp_path / "run.log")),
        (root, logging.StreamHandler(console)),
        (library, logging.StreamHandler(own_stderr)),
    ]
    for logger, handler in handlers:
        logger.addHandler(handler)
    try:
        with pytest.raises(DataError, match="line 2: malformed JSON"):
            JsonlData(JsonlDataConfig(path=str(path)), seed=0)
    finally:
        for logger, handler in handlers:
            logger.removeHandler(handler)
            handler.close()
    assert "Failed to load JSON" in (tmp_path / "run.log").read_text()
    assert "Failed to load JSON" not in console.getvalue() + own_stderr.getvalue()
    assert library.propagate  # restored after the load


def write_rows(path: Path, rows: list[dict | None]) -> Path:
    """One JSON object per line; None writes a blank line (which holds no record)."""
    path.write_text("".join("\n" if row is None else json.dumps(row) + "\n" for row in rows))
    return path


ROWS = [
    {"question": "1+1", "answer": "2"},
    {"question": "2+2"},  # line 2: no answer
    None,  # line 3: blank
    {"question": "3+3", "answer": None},  # line 4
    {"question": None, "answer": "8"},  # line 5
    {"question": "5+5", "answer": "  "},  # line 6: blank answer
    {"question": "6+6", "answer": "12"},
]


def test_a_row_without_question_or_answer_is_named_by_file_and_line(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(DataError, match=rf"{path} line 2: field 'answer' is missing.*data.skip_invalid=true"):
        JsonlData(JsonlDataConfig(path=str(path)), seed=0)


def test_skip_invalid_skips_and_counts_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    with caplog.at_level(logging.WARNING):
        data = JsonlData(JsonlDataConfig(path=str(path), skip_invalid=True), seed=0)
    assert [(e.id, e.reference) for e in data.train_examples] == [("train/0", "2"), ("train/5", "12")]
    warnings = [r.getMessage() for r in caplog.records if "skip_invalid" in r.getMessage()]
    assert len(warnings) == 1
    assert "skipped 4 invalid train rows" in warnings[0]
    assert f"{path} line 2: field 'answer'" in warnings[0] and f"{path} line 5: field 'question'" in warnings[0]


def test_a_directory_split_names_its_file(tmp_path: Path) -> None:
    write_rows(tmp_path / "train.jsonl", ROWS[:1])
    write_rows(tmp_path / "test.jsonl", [*ROWS[:1], None, {"question": "q"}])
    data = JsonlData(JsonlDataConfig(path=str(tmp_path), held_out_split="test"), seed=0)
    with pytest.raises(DataError, match=rf"{tmp_path / 'test.jsonl'} line 3: field 'answer'"):
        data.held_out(1)


def test_records_of_a_binary_file_are_named_by_split_and_index(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"question": "1+1", "answer": "2"}, {"question": "2+2", "answer": None}]).to_parquet(
        str(path)
    )
    with pytest.raises(DataError, match=rf"data.path='{path}', train record 1: field 'answer'"):
        JsonlData(JsonlDataConfig(path=str(path)), seed=0)


def test_gsm8k_rows_without_an_answer_or_its_marker(tmp_path: Path) -> None:
    rows = [
        {"question": "q1", "answer": "so\n#### 3"},
        {"question": "q2", "answer": None},
        {"question": "q3", "answer": "7"},
    ]
    path = write_rows(tmp_path / "gsm8k.jsonl", rows)
    with pytest.raises(DataError, match=rf"{path} line 2: field 'answer' is missing"):
        Gsm8kData(Gsm8kDataConfig(path=str(path), held_out_split=""), seed=0)
    data = Gsm8kData(Gsm8kDataConfig(path=str(path), held_out_split="", skip_invalid=True), seed=0)
    assert [e.reference for e in data.train_examples] == ["3"]
    write_rows(path, [rows[0], rows[2]])
    with pytest.raises(DataError, match=rf"{path} line 2: no '####' in the GSM8K answer '7'"):
        Gsm8kData(Gsm8kDataConfig(path=str(path), held_out_split=""), seed=0)


def test_math_rows_without_a_problem(tmp_path: Path) -> None:
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": None, "answer": "4"}, {"problem": "3+3?", "answer": "6"}]
    path = write_rows(tmp_path / "math.jsonl", rows)
    with pytest.raises(DataError, match=rf"{path} line 2: field 'problem' is missing"):
        MathData(MathDataConfig(path=str(path), subjects=[], held_out_split=""), seed=0)
    data = MathData(MathDataConfig(path=str(path), subjects=[], held_out_split="", skip_invalid=True), seed=0)
    assert sorted(e.reference for e in data.train_examples) == ["2", "6"]
