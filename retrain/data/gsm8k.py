"""`data=gsm8k`: grade-school word problems (Cobbe et al.); the reference follows `####`.

The reference drops thousands separators ("10,000" -> "10000"): models usually write numbers
without them, and with `reward=match` a separator would turn a right answer into a miss.
"""

from __future__ import annotations

from retrain.data.base import ExampleData, fixed_subset
from retrain.data.config import Gsm8kDataConfig
from retrain.data.jsonl import load_records, require_fields
from retrain.data.prompts import check_template, fill_template
from retrain.data.records import InvalidRows, SplitRecords
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import Example

ANSWER_MARKER = "####"


def gsm8k_reference(answer: str) -> str:
    """The final answer after the last `####` of a worked solution, without thousands commas."""
    if ANSWER_MARKER not in answer:
        raise ValueError(f"no {ANSWER_MARKER!r} in the GSM8K answer {answer[-120:]!r}")
    return answer.rsplit(ANSWER_MARKER, 1)[1].strip().replace(",", "")


@built_in
@takes_settings(Gsm8kDataConfig)
class Gsm8kData(ExampleData):
    """GSM8K's train split for training and its test split as the held-out set."""

    def __init__(self, config: Gsm8kDataConfig, seed: int) -> None:
        check_template(config.prompt_template, {"question"}, "data.prompt_template")

        def load(which: str, split_setting: str) -> list[Example]:
            dataset = load_records(config.path, which, config.config_name or None, split_setting=split_setting)
            require_fields(
                dataset,
                {"GSM8K's question field": "question", "GSM8K's answer field": "answer"},
                f"{config.path} ({which})",
            )
            records = SplitRecords(config.path, which, config.config_name or None)
            invalid = InvalidRows("gsm8k", records, config.skip_invalid)
            examples = []
            for index, record in records.enumerate(dataset):
                if invalid.rejects_blank(index, record, ("question", "answer")):
                    continue
                try:
                    reference = gsm8k_reference(record["answer"])
                except ValueError as exc:
                    invalid.reject(index, str(exc))
                    continue
                examples.append(
                    Example(
                        prompt=fill_template(config.prompt_template, question=str(record["question"])),
                        reference=reference,
                        id=f"gsm8k/{which}/{index}",
                        extra={"question": str(record["question"])},
                    )
                )
            invalid.report()
            return examples

        super().__init__(
            name="gsm8k",
            train=fixed_subset(load(config.split, "data.split"), config.max_examples),
            seed=seed,
            held_out=(lambda: load(config.held_out_split, "data.held_out_split")) if config.held_out_split else None,
        )
