"""Schemas of the `data` config group (conf/data/*.yaml).

Every source is built as `instantiate(cfg.data, seed=seed)` (retrain.run.build_part): the seed only orders the
examples. Each schema owns its fields and checks them (a built-in converts its keys through it,
retrain.settings_object); this module stays light (no `datasets` import), since the CLI imports it before it knows which source
it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retrain.data.arithmetic import SCHEMAS as ARITHMETIC_SCHEMAS
from retrain.data.prompts import DEFAULT_PROMPT_TEMPLATE
from retrain.environments.config import SCHEMAS as ENVIRONMENT_SCHEMAS

MATH_PATH = "EleutherAI/hendrycks_math"
# The five subjects of the original retrain runs (4,551 problems in MATH's train split).
SEED_SUBJECTS = ("intermediate_algebra", "precalculus", "number_theory", "counting_and_probability", "geometry")
GSM8K_PATH = "openai/gsm8k"


@dataclass
class MathDataConfig:
    """MATH by subject: a Hub id, a local copy of it, or a file/directory of MATH-style records."""

    _target_: str = "retrain.data.math.MathData"
    path: str = MATH_PATH
    subjects: list[str] = field(default_factory=lambda: list(SEED_SUBJECTS))  # [] = all subjects
    split: str = "train"  # a single local file is one split, "train"
    held_out_split: str = "test"  # "" = no held-out set
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE  # {question} is the problem
    max_examples: int = 0  # 0 = all; else a fixed subset, the same for every seed
    skip_invalid: bool = False  # a row with no problem: an error naming it, or (true) skipped with a warning


@dataclass
class Gsm8kDataConfig:
    """GSM8K: a Hub id or a local directory with train.jsonl and test.jsonl."""

    _target_: str = "retrain.data.gsm8k.Gsm8kData"
    path: str = GSM8K_PATH
    config_name: str = "main"  # ignored by local copies, which declare no configs
    split: str = "train"
    held_out_split: str = "test"
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    max_examples: int = 0
    skip_invalid: bool = False  # a row with no question or answer (or no ####): an error, or (true) skipped


@dataclass
class JsonlDataConfig:
    """Any jsonl/json/parquet/csv file, data set directory or Hub id, fields named by you."""

    _target_: str = "retrain.data.jsonl.JsonlData"
    path: str = ""  # required: a file, a data set directory or a Hub id
    split: str = "train"
    held_out_split: str = ""
    config_name: str = ""
    question_field: str = "question"  # fills {question} in the prompt template
    answer_field: str = "answer"  # the reference the reward compares against
    id_field: str = ""  # "" = "<split>/<index>"
    extra_fields: list[str] = field(default_factory=list)  # copied into Example.extra (reward **extra)
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    max_examples: int = 0
    skip_invalid: bool = False  # a row with no question or answer: an error naming it, or (true) skipped


# the schemas whose `path` is a local file or directory, or else a Hub id (retrain.hub.local_path tells which):
# a local one that does not exist is refused before anything loads (retrain/config_checks/validation.py)
LOCAL_OR_HUB_PATHS = (MathDataConfig, Gsm8kDataConfig, JsonlDataConfig)

SCHEMAS: dict[str, type] = {
    "base_math": MathDataConfig,
    "base_gsm8k": Gsm8kDataConfig,
    "base_jsonl": JsonlDataConfig,
    **ARITHMETIC_SCHEMAS,  # the generated offline task keeps its schema next to its code
    **ENVIRONMENT_SCHEMAS,  # data=verifiers: an environment that samples and scores its own rollouts
}
