"""`data=jsonl`: any record file or data set directory, field names configured."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import datasets
import pytest
import yaml

from retrain.config import compose
from retrain.data.config import JsonlDataConfig
from retrain.data.jsonl import JsonlData
from retrain.errors import ConfigError
from retrain.run import build_part
from tests.conftest import REPO, run_cli

RECORDS = [
    {"problem": f"What is {n} squared?", "final": f" {n * n} ", "uid": f"sq-{n}", "difficulty": n % 3}
    for n in range(1, 21)
]
FIELDS = {"question_field": "problem", "answer_field": "final", "id_field": "uid", "extra_fields": ["difficulty"]}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(params=["jsonl", "parquet", "csv"])
def record_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / f"squares.{request.param}"
    if request.param == "jsonl":
        return write_jsonl(path, RECORDS)
    dataset = datasets.Dataset.from_list(RECORDS)
    dataset.to_parquet(str(path)) if request.param == "parquet" else dataset.to_csv(str(path), index=False)
    return path


def test_any_file_type_with_configured_fields(record_file: Path) -> None:
    data = JsonlData(JsonlDataConfig(path=str(record_file), prompt_template="Problem: {question}", **FIELDS), seed=0)
    by_id = {e.id: e for e in data.train_examples}
    assert len(data) == 20
    example = by_id["sq-7"]
    assert example.prompt == "Problem: What is 7 squared?"
    assert example.reference == "49"  # stripped
    assert example.extra == {"question": "What is 7 squared?", "difficulty": 1}


def test_a_missing_field_names_its_setting_and_the_fields_there(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "squares.jsonl", RECORDS)
    with pytest.raises(ConfigError, match=r"data.answer_field='answer': no such field.*'final'"):
        JsonlData(JsonlDataConfig(path=str(path), question_field="problem"), seed=0)


def test_a_directory_with_split_files_and_a_held_out_split(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", RECORDS[:15])
    write_jsonl(tmp_path / "test.jsonl", RECORDS[15:])
    data = JsonlData(JsonlDataConfig(path=str(tmp_path), held_out_split="test", **FIELDS), seed=0)
    assert len(data) == 15
    assert sorted(e.id for e in data.held_out(5)) == [f"sq-{n}" for n in range(16, 21)]
    with pytest.raises(ConfigError, match="no held-out split: set data.held_out_split"):
        JsonlData(JsonlDataConfig(path=str(tmp_path), **FIELDS), seed=0).held_out(1)
    with pytest.raises(ConfigError, match="data.split='validation'"):
        JsonlData(JsonlDataConfig(path=str(tmp_path), split="validation", **FIELDS), seed=0)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing.jsonl", "data.path='missing.jsonl': no such file"),
        ("./nowhere", "data.path='./nowhere': no such file"),
    ],
)
def test_paths_that_do_not_exist_are_not_looked_up_on_the_hub(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JsonlData(JsonlDataConfig(path=path), seed=0)


def test_unsupported_files_and_templates_are_refused(tmp_path: Path) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# not data\n")
    with pytest.raises(ConfigError, match="unsupported file type '.md'"):
        JsonlData(JsonlDataConfig(path=str(notes)), seed=0)
    path = write_jsonl(tmp_path / "squares.jsonl", RECORDS)
    with pytest.raises(ConfigError, match=r"data.prompt_template must contain \{question\}"):
        JsonlData(JsonlDataConfig(path=str(path), prompt_template="no slot", **FIELDS), seed=0)


def test_data_jsonl_needs_a_path_and_composes_with_one(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "squares.jsonl", RECORDS)
    with pytest.raises(Exception, match="data=jsonl needs data.path"):
        build_part(compose(["data=jsonl"]), "data", seed=0)
    cfg = compose(
        [
            "data=jsonl",
            f"data.path={path}",
            "data.question_field=problem",
            "data.answer_field=final",
            "data.extra_fields=[difficulty]",
        ]
    )
    assert len(build_part(cfg, "data", seed=0)) == 20


def documented_template_arguments() -> list[str]:
    """Every `"data.prompt_template='...'"` argument docs/data.md shows, as bash passes it on."""
    text = (REPO / "docs" / "data.md").read_text()
    quoted = re.findall(r"\"data\.prompt_template='[^'\n]*'\"", text)
    assert len(quoted) >= 2, "docs/data.md shows the two-quote form for prompt templates"
    return [shlex.split(argument)[0] for argument in quoted]


@pytest.mark.parametrize("argument", documented_template_arguments())
def test_the_documented_template_form_composes_through_the_cli(tmp_path: Path, argument: str) -> None:
    """The docs' form, after bash has removed its own quotes, gives the template between Hydra's."""
    path = write_jsonl(tmp_path / "squares.jsonl", RECORDS)
    shown = run_cli(["data=jsonl", f"data.path={path}", argument, "--cfg", "job"], cwd=tmp_path).stdout
    template = argument.split("=", 1)[1].strip("'")
    assert yaml.safe_load(shown)["data"]["prompt_template"] == template


def test_braces_without_hydras_quotes_fail_naming_the_form_that_works(tmp_path: Path) -> None:
    """`data.prompt_template='Q: {question}'` in bash: Hydra gets the braces bare."""
    result = run_cli(["data=jsonl", "data.prompt_template=Q: {question}", "--cfg", "job"], cwd=tmp_path, check=False)
    assert result.returncode != 0
    assert "quote the value for Hydra inside the shell's quotes: \"data.prompt_template='Q: {question}'\"" in (
        result.stderr
    )
