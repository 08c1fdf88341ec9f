"""`data=math`: competition problems from MATH (Hendrycks et al.), filtered by subject.

Works with the Hub mirror `EleutherAI/hendrycks_math` (one config per subject, loaded one by one),
with a local copy of it, and with any file or directory of MATH-style records (`problem`,
`solution`, optionally `answer`, and `subject` or `type`), e.g. MATH-500's test.jsonl.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import datasets

from retrain.data.base import ExampleData, fixed_subset
from retrain.data.config import MathDataConfig
from retrain.data.jsonl import config_names, load_records, require_fields
from retrain.data.prompts import check_template, fill_template
from retrain.data.records import InvalidRows, SplitRecords
from retrain.errors import ConfigError
from retrain.plugins import built_in
from retrain.reward.extract import last_boxed
from retrain.settings_object import takes_settings
from retrain.types import Example

log = logging.getLogger(__name__)

SUBJECT_FIELDS = ("subject", "type")  # MATH-500 says "subject", the original MATH files "type"


def normalize_subject(name: str) -> str:
    """ "Counting & Probability" -> "counting_and_probability" (both spellings occur in the wild)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().replace("&", " and ")).strip("_")


def math_reference(record: dict[str, Any]) -> str | None:
    """The `answer` field when present, else the content of the solution's last `\\boxed{}`."""
    answer = record.get("answer")
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    boxed = last_boxed(str(record.get("solution") or ""))
    return boxed.strip() if boxed and boxed.strip() else None


@built_in
@takes_settings(MathDataConfig)
class MathData(ExampleData):
    """MATH problems of the chosen subjects; the reference is the final boxed answer."""

    def __init__(self, config: MathDataConfig, seed: int) -> None:
        check_template(config.prompt_template, {"question"}, "data.prompt_template")
        wanted = [normalize_subject(subject) for subject in config.subjects]
        configs = {normalize_subject(name): name for name in config_names(config.path)}
        # A data set with one config per subject (the Hub mirror) is loaded config by config.
        by_config = (
            all(subject in configs for subject in wanted) if wanted else len(configs) > 1 and "default" not in configs
        )

        def load(which: str, split_setting: str) -> list[Example]:
            parts: list[tuple[str | None, datasets.Dataset]]
            if by_config:
                chosen = wanted or sorted(configs)
                parts = [
                    (subject, load_records(config.path, which, configs[subject], split_setting=split_setting))
                    for subject in chosen
                ]
            else:
                parts = [(None, load_records(config.path, which, split_setting=split_setting))]
            examples: list[Example] = []
            seen: set[str] = set()
            skipped = 0
            for config_subject, dataset in parts:
                require_fields(dataset, {"MATH's problem field": "problem"}, f"{config.path} ({which})")
                records = SplitRecords(config.path, which, configs[config_subject] if config_subject else None)
                invalid = InvalidRows("math", records, config.skip_invalid)
                for index, record in records.enumerate(dataset):
                    subject = config_subject or _record_subject(record)
                    if wanted and not by_config:
                        if subject is None:
                            raise ConfigError(
                                f"data.path={config.path!r}: records carry no {' or '.join(SUBJECT_FIELDS)} "
                                f"field, so data.subjects cannot filter them; set data.subjects=[]"
                            )
                        seen.add(subject)
                        if subject not in wanted:
                            continue
                    if invalid.rejects_blank(index, record, ("problem",)):
                        continue
                    example = _math_example(record, subject, which, index, config.prompt_template)
                    if example is None:
                        skipped += 1
                    else:
                        examples.append(example)
                invalid.report()
            absent = sorted(set(wanted) - seen) if wanted and not by_config else []
            if absent:
                raise ConfigError(
                    f"data.subjects: {absent} not in the {which} split of {config.path!r} (its subjects: {sorted(seen)})"
                )
            if skipped:
                log.warning(
                    "data=math: skipped %d %s records of %s with no answer and no \\boxed{} in the solution",
                    skipped,
                    which,
                    config.path,
                )
            return examples

        super().__init__(
            name="math",
            train=fixed_subset(load(config.split, "data.split"), config.max_examples),
            seed=seed,
            held_out=(lambda: load(config.held_out_split, "data.held_out_split")) if config.held_out_split else None,
        )


def _record_subject(record: dict[str, Any]) -> str | None:
    for field in SUBJECT_FIELDS:
        value = record.get(field)
        if isinstance(value, str) and value:
            return normalize_subject(value)
    return None


def _math_example(record: dict[str, Any], subject: str | None, split: str, index: int, template: str) -> Example | None:
    reference = math_reference(record)
    if reference is None:
        return None
    problem = str(record["problem"])
    record_id = record.get("unique_id") or f"{subject or 'math'}/{split}/{index}"
    return Example(
        prompt=fill_template(template, question=problem),
        reference=reference,
        id=str(record_id),
        extra={"question": problem, "subject": subject, "level": record.get("level")},
    )
