"""`reward=match` and the boxed-answer extraction it shares with data=math (docs/rewards.md)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrain.reward.extract import last_boxed
from retrain.reward.match import match_reward


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{1} then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # the last box, braces nested
        ("\\fbox{7}", "7"),
        ("\\boxed {7}", "7"),
        ("\\boxed{\\fbox{5}}", "5"),  # last by where it opens
        ("cut off \\boxed{\\frac{1}{2", "\\frac{1}{2"),  # unbalanced: the rest of the string
        ("\\boxed{}", ""),
        ("no box at all", None),
        ("\\boxedx{3}", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


balanced = st.recursive(
    st.text(alphabet="ab1+ \\", max_size=5),
    lambda inner: st.builds(lambda a, b: a + "{" + b + "}", inner, inner),
    max_leaves=6,
)


@settings(max_examples=100, deadline=None)
@given(prefix=st.text(alphabet="xyz {}", max_size=20), answer=balanced, suffix=st.text(alphabet="xyz. ", max_size=10))
def test_the_last_box_is_found_whatever_precedes_it(prefix: str, answer: str, suffix: str) -> None:
    assert last_boxed(f"{prefix}\\boxed{{{answer}}}{suffix}") == answer


@pytest.mark.parametrize(
    ("response", "reference", "reward"),
    [
        ("The answer is \\boxed{ 42 }", "42", 1.0),
        ("\\boxed{41} no wait \\boxed{42}", " 42\n", 1.0),
        ("\\boxed{42} no wait \\boxed{41}", "42", 0.0),
        ("42", "42", 0.0),  # unboxed answers never match
        ("\\boxed{0.5}", "\\frac{1}{2}", 0.0),  # exact strings only: reward=math knows they are equal
    ],
)
def test_match_reward(response: str, reference: str, reward: float) -> None:
    assert match_reward(response, reference) == reward


@pytest.mark.parametrize("response", ["no box", "\\boxed{}", "\\boxed{ }"])
@pytest.mark.parametrize("reference", ["", "   "])
def test_an_empty_reference_never_matches(response: str, reference: str) -> None:
    assert match_reward(response, reference) == 0.0


def test_extra_keywords_are_accepted() -> None:
    assert match_reward("\\boxed{3}", "3", subject="algebra", level=2) == 1.0
