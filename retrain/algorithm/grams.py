"""The strategic grams that mark planning tokens, and how `algorithm.planning.grams` is read.

Kept apart from the detector so that the config schema can name the defaults without importing
torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from retrain.errors import ConfigError

DEFAULT_GRAMS: tuple[str, ...] = (
    "wait let me",
    "let me think",
    "on second thought",
    "let me check",
    "let me verify",
    "is this right",
    "double check",
    "try another approach",
    "go back and",
    "start over",
    "that's not right",
    "that doesn't work",
    "another way to",
    "or we could",
    "what if we",
    "notice that",
    "the key is",
    "the key insight",
)
DETECTORS = ("regex", "semantic")  # algorithm.planning.detector
DEFAULT_SEMANTIC_MODEL = "sentence-transformers/all-MiniLM-L6-v2"  # the original retrain's default encoder
DEFAULT_SEMANTIC_THRESHOLD = 0.6  # cosine similarity to the nearest gram from which a clause is planning
APOSTROPHES = "'\u2019\u2018\u02bc"  # ASCII, right/left single quotation marks, modifier apostrophe


def parse_grams(grams: Any) -> tuple[str, ...]:
    """`algorithm.planning.grams`: a list, a JSON array string, or a comma-separated string.

    None or an empty string means the 18 default grams.
    """
    if grams is None or (isinstance(grams, str) and not grams.strip()):
        return DEFAULT_GRAMS
    if isinstance(grams, str):
        text = grams.strip()
        if text.startswith("["):
            try:
                grams = json.loads(text)
            except json.JSONDecodeError as error:
                raise ConfigError(f"algorithm.planning.grams={grams!r} is not a valid JSON array: {error}") from error
        else:
            grams = text.split(",")
    if not isinstance(grams, Sequence) or isinstance(grams, str):
        raise ConfigError(f"algorithm.planning.grams={grams!r} must be a list of phrases or a comma-separated string")
    parsed = tuple(" ".join(str(g).split()) for g in grams if isinstance(g, str))
    if len(parsed) != len(grams) or not parsed or not all(parsed):
        raise ConfigError(f"algorithm.planning.grams={list(grams)!r} must be a non-empty list of non-empty phrases")
    return parsed
