"""`data=gsm8k` on the GSM8K jsonl files in ../shared/data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from retrain.config import compose
from retrain.data.config import Gsm8kDataConfig
from retrain.data.gsm8k import Gsm8kData, gsm8k_reference
from retrain.errors import ConfigError, DataError
from retrain.run import build_part


def test_train_split_for_training_test_split_held_out(gsm8k_dir: Path) -> None:
    data = Gsm8kData(Gsm8kDataConfig(path=str(gsm8k_dir)), seed=0)
    assert len(data) == 7473
    held_out = data.held_out(1319)
    assert len({e.id for e in held_out}) == 1319 and all(e.id.startswith("gsm8k/test/") for e in held_out)
    with pytest.raises(ConfigError, match="more than the 1319 held-out"):
        data.held_out(1320)
    # Every final answer is a plain integer once thousands commas are gone.
    assert all(re.fullmatch(r"-?\d+", e.reference) for e in data.train_examples + held_out)


def test_the_reference_is_what_follows_the_marker_without_commas(gsm8k_dir: Path) -> None:
    record = json.loads((gsm8k_dir / "train.jsonl").read_text().splitlines()[345])
    assert record["answer"].endswith("#### 1,080")
    example = next(
        e for e in Gsm8kData(Gsm8kDataConfig(path=str(gsm8k_dir)), seed=0).train_examples if e.id == "gsm8k/train/345"
    )
    assert example.reference == "1080"
    assert example.extra == {"question": record["question"]}
    assert example.prompt.startswith(record["question"]) and "\\boxed{}" in example.prompt


@pytest.mark.parametrize(
    ("answer", "reference"),
    [("so 3 + 4 = <<3+4=7>>7\n#### 7", "7"), ("#### 10,000", "10000"), ("a #### b\n####  -3 ", "-3")],
)
def test_gsm8k_reference(answer: str, reference: str) -> None:
    assert gsm8k_reference(answer) == reference


def test_a_record_without_the_marker_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "42"}) + "\n")
    with pytest.raises(DataError, match=f"{path} line 1: no '####'"):
        Gsm8kData(Gsm8kDataConfig(path=str(path)), seed=0)


def test_a_single_file_works_like_the_hub_id(gsm8k_dir: Path) -> None:
    cfg = compose(["data=gsm8k", f"data.path={gsm8k_dir / 'test.jsonl'}", "data.held_out_split="])
    data = build_part(cfg, "data", seed=5)
    assert len(data) == 1319
    first = [e.id for e in data.next_batch(20)]
    assert first == [e.id for e in build_part(cfg, "data", seed=5).next_batch(20)]
