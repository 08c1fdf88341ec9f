"""`data=math` on MATH-500 and on a Hub-shaped local copy (one config per subject)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from retrain.config import compose
from retrain.data.config import SEED_SUBJECTS, MathDataConfig
from retrain.data.math import MathData, math_reference, normalize_subject
from retrain.errors import ConfigError
from retrain.run import build_part

# MATH-500 subject counts (shared/data/README.md)
SEED_SUBJECT_COUNT = 97 + 56 + 62 + 38 + 41


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def ids(batches: list) -> list[str]:
    return [example.id for batch in batches for example in batch]


def test_the_seed_subjects_of_math500(math500: Path) -> None:
    data = MathData(MathDataConfig(path=str(math500)), seed=0)
    records = {r["unique_id"]: r for r in read_jsonl(math500)}
    assert len(data) == SEED_SUBJECT_COUNT
    for example in data.train_examples:
        record = records[example.id]
        assert example.reference == record["answer"]
        assert example.prompt.startswith(record["problem"]) and "\\boxed{}" in example.prompt
        assert example.extra == {
            "question": record["problem"],
            "subject": normalize_subject(record["subject"]),
            "level": record["level"],
        }
    assert set(Counter(e.extra["subject"] for e in data.train_examples)) == set(SEED_SUBJECTS)


@pytest.mark.parametrize(("subjects", "count"), [([], 500), (["Intermediate Algebra", "counting & probability"], 135)])
def test_subject_filter_accepts_either_spelling(math500: Path, subjects: list[str], count: int) -> None:
    assert len(MathData(MathDataConfig(path=str(math500), subjects=subjects), seed=0)) == count


def test_an_unknown_subject_names_the_setting_and_the_choices(math500: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.subjects: \['topology'\].*prealgebra"):
        MathData(MathDataConfig(path=str(math500), subjects=["algebra", "topology"]), seed=0)


def test_order_is_deterministic_per_seed_across_epochs(math500: Path) -> None:
    def draw(seed: int) -> list[str]:
        data = MathData(MathDataConfig(path=str(math500)), seed=seed)
        return ids([data.next_batch(50) for _ in range(8)])  # 400 draws: crosses an epoch of 294

    first = draw(1)
    assert first == draw(1)
    assert first != draw(2)
    assert set(first[:SEED_SUBJECT_COUNT]) == {
        e.id for e in MathData(MathDataConfig(path=str(math500)), seed=1).train_examples
    }


def test_the_cursor_resumes_the_same_order(math500: Path) -> None:
    data = MathData(MathDataConfig(path=str(math500)), seed=3)
    for _ in range(7):
        data.next_batch(40)
    state = json.loads(json.dumps(data.state_dict()))  # as trainer_state.json stores it
    expected = ids([data.next_batch(40) for _ in range(3)])
    resumed = MathData(MathDataConfig(path=str(math500)), seed=3)
    resumed.load_state_dict(state)
    assert ids([resumed.next_batch(40) for _ in range(3)]) == expected
    smaller = MathData(MathDataConfig(path=str(math500), max_examples=10), seed=3)
    with pytest.raises(ConfigError, match="cursor is for 294 examples"):
        smaller.load_state_dict(state)


def test_max_examples_keeps_one_fixed_subset_for_every_seed(math500: Path) -> None:
    subsets = [
        {e.id for e in MathData(MathDataConfig(path=str(math500), max_examples=50), seed=seed).train_examples}
        for seed in (0, 1)
    ]
    assert len(subsets[0]) == 50 and subsets[0] == subsets[1]
    assert (
        len(
            {
                e.id.split("/")[1]
                for e in MathData(MathDataConfig(path=str(math500), max_examples=50), seed=0).train_examples
            }
        )
        > 1
    )


def test_a_single_file_has_no_test_split_to_hold_out(math500: Path) -> None:
    data = MathData(MathDataConfig(path=str(math500)), seed=0)
    with pytest.raises(ConfigError, match="data.held_out_split='test'.*single file"):
        data.held_out(10)
    with pytest.raises(ConfigError, match="no held-out split: set data.held_out_split"):
        MathData(MathDataConfig(path=str(math500), held_out_split=""), seed=0).held_out(10)


@pytest.fixture
def hub_shaped_math(math500: Path, tmp_path: Path) -> Path:
    """MATH-500 laid out like EleutherAI/hendrycks_math: a config per subject, `type` and `level`
    spelled as there, no `answer` field (the reference comes from the solution's last box)."""
    by_subject: dict[str, list[dict]] = {}
    for record in read_jsonl(math500):
        by_subject.setdefault(normalize_subject(record["subject"]), []).append(
            {
                "problem": record["problem"],
                "level": f"Level {record['level']}",
                "type": record["subject"],
                "solution": record["solution"],
            }
        )
    lines = ["---", "configs:"]
    for subject, records in sorted(by_subject.items()):
        lines += [f"- config_name: {subject}", "  data_files:"]
        for split, part in (("train", records[0::2]), ("test", records[1::2])):
            (tmp_path / subject).mkdir(exist_ok=True)
            (tmp_path / subject / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
            lines += [f"  - split: {split}", f"    path: {subject}/{split}.jsonl"]
    (tmp_path / "README.md").write_text("\n".join([*lines, "---", ""]))
    return tmp_path


def test_a_hub_shaped_copy_loads_config_by_config(hub_shaped_math: Path, math500: Path) -> None:
    data = MathData(MathDataConfig(path=str(hub_shaped_math)), seed=0)
    answers = {r["problem"]: r["answer"] for r in read_jsonl(math500)}
    train_counts = {
        "intermediate_algebra": 49,
        "precalculus": 28,
        "number_theory": 31,
        "counting_and_probability": 19,
        "geometry": 21,
    }
    assert Counter(e.extra["subject"] for e in data.train_examples) == train_counts
    assert all(e.reference == answers[e.extra["question"]] for e in data.train_examples)
    assert data.train_examples[0].id == "intermediate_algebra/train/0"
    held_out = data.held_out(100)
    assert len(held_out) == 100 and {e.id for e in held_out}.isdisjoint(e.id for e in data.train_examples)
    assert held_out == MathData(MathDataConfig(path=str(hub_shaped_math)), seed=9).held_out(100)  # same for every seed
    assert len({e.extra["subject"] for e in held_out}) == 5  # a mix, not the first subject's head
    assert len(MathData(MathDataConfig(path=str(hub_shaped_math), subjects=[]), seed=0)) == 251  # all seven configs


def test_references_come_from_the_answer_field_else_the_last_box() -> None:
    assert math_reference({"answer": " 5 ", "solution": "\\boxed{4}"}) == "5"
    assert math_reference({"solution": "a \\boxed{1} b \\boxed{\\frac{1}{2}}."}) == "\\frac{1}{2}"
    assert math_reference({"answer": "", "solution": "no box"}) is None


def test_records_without_a_subject_cannot_be_filtered(tmp_path: Path) -> None:
    path = tmp_path / "problems.jsonl"
    path.write_text(json.dumps({"problem": "1+1?", "solution": "\\boxed{2}"}) + "\n")
    with pytest.raises(ConfigError, match="no subject or type field.*data.subjects=\\[\\]"):
        MathData(MathDataConfig(path=str(path)), seed=0)
    assert [e.reference for e in MathData(MathDataConfig(path=str(path), subjects=[]), seed=0).train_examples] == ["2"]


@pytest.mark.parametrize(
    ("name", "normal"),
    [
        ("Intermediate Algebra", "intermediate_algebra"),
        ("Counting & Probability", "counting_and_probability"),
        ("number_theory", "number_theory"),
        ("Precalculus", "precalculus"),
    ],
)
def test_subject_names_normalise(name: str, normal: str) -> None:
    assert normalize_subject(name) == normal


def test_data_math_with_a_local_file_from_the_command_line(math500: Path) -> None:
    cfg = compose(["data=math", f"data.path={math500}", "data.prompt_template='Q: {question}'"])
    data = build_part(cfg, "data", seed=0)
    assert len(data) == SEED_SUBJECT_COUNT
    assert data.next_batch(1)[0].prompt.startswith("Q: ")
