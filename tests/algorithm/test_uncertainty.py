"""Uncertainty kinds: exact values, the 50.0 cap, aliases, dotted-path plugins, clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from retrain.algorithm.uncertainty import predictive_variance, resolve_uncertainty, shannon_entropy, surprisal
from retrain.errors import ConfigError

LOGPROBS = torch.tensor([[-0.5, -2.0, -80.0, 0.0]])
MASK = torch.ones(1, 4, dtype=torch.bool)


def test_surprisal_is_minus_logprob_capped_at_50():
    assert surprisal(LOGPROBS, MASK, None).tolist() == [[0.5, 2.0, 50.0, 0.0]]


def test_predictive_variance_is_p_times_one_minus_p():
    p = [math.exp(-0.5), math.exp(-2.0), math.exp(-50.0), 1.0]
    expected = torch.tensor([[q * (1 - q) for q in p]])
    torch.testing.assert_close(predictive_variance(LOGPROBS, MASK, None), expected)


def test_shannon_entropy_reads_the_engines_entropies_and_refuses_without_them():
    entropies = torch.tensor([[0.1, 2.5, 70.0, 0.0]])
    assert shannon_entropy(LOGPROBS, MASK, entropies).tolist() == [[pytest.approx(0.1), 2.5, 50.0, 0.0]]
    with pytest.raises(ConfigError, match="shannon_entropy.*needs per-token entropies"):
        shannon_entropy(LOGPROBS, MASK, None)


@pytest.mark.parametrize(
    "alias, kind",
    [
        ("pred_var", "predictive_variance"),
        ("bernoulli_variance", "predictive_variance"),
        ("entropy", "shannon_entropy"),
        ("shannon", "shannon_entropy"),
        ("surprisal", "surprisal"),
    ],
)
def test_aliases_resolve_to_their_kind(alias, kind):
    assert resolve_uncertainty(alias).name == kind


def test_only_shannon_entropy_needs_entropies_and_metric_prefixes_follow_the_kind():
    kinds = {name: resolve_uncertainty(name) for name in ("surprisal", "predictive_variance", "shannon_entropy")}
    assert [k.needs_entropies for k in kinds.values()] == [False, False, True]
    assert [k.metric_prefix for k in kinds.values()] == ["surprisal", "predictive_variance", "entropy"]


def test_a_dotted_path_loads_a_user_function_with_its_declarations():
    kind = resolve_uncertainty("tests.plugins.algorithm_plugins.miss_probability")
    assert (kind.metric_prefix, kind.needs_entropies) == ("miss", False)
    torch.testing.assert_close(kind.fn(LOGPROBS, MASK, None), 1.0 - LOGPROBS.exp())
    assert resolve_uncertainty("tests.plugins.algorithm_plugins.entropy_gap").needs_entropies


@pytest.mark.parametrize(
    "spec, message",
    [
        ("surprise", r"algorithm.uncertainty='surprise' is not a known uncertainty kind \(surprisal, "),
        (
            "tests.plugins.algorithm_plugins.no_such_fn",
            "algorithm.uncertainty='tests.plugins.algorithm_plugins.no_such_fn': cannot import",
        ),
        ("tests.plugins.algorithm_plugins.ClipAdvantages.token_varying", "is a bool, not a function"),
    ],
)
def test_unknown_kinds_fail_with_the_key_and_value(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve_uncertainty(spec)
