"""Preflight: the configured algorithm meets the backend on a synthetic step before any model loads."""

from __future__ import annotations

import pytest

from retrain.algorithm.preflight import preflight
from retrain.backend.base import CONSERVATIVE_CAPABILITIES, Capabilities
from retrain.errors import ConfigError
from retrain.plugins import PluginOutputError
from tests.algorithm.helpers import build

PLUGINS = "tests.plugins.algorithm_plugins"
LOCAL = Capabilities(returns_entropies=True)  # docs/backends.md's table: local preserves token advantages
TINKER = Capabilities(resume_runtime_dependent=True)
PRIME_RL = Capabilities(reports_sync_loss=False, preserves_token_advantages=False)


@pytest.mark.parametrize("name", ["maxrl_gtpo_sepa", "maxrl_gtpo_hicra", "reinforce_pp_gtpo_sepa_amp_c", "grpo_none"])
def test_every_kind_of_preset_passes_on_backends_that_keep_token_advantages(name):
    for capabilities in (LOCAL, TINKER):
        report = preflight(build(name), capabilities, backend_name="local")
        assert report.token_varying == (name != "grpo_none")
        assert "sepa_lambda" in report.metric_keys


@pytest.mark.parametrize("name", ["maxrl_gtpo", "maxrl_gtpo_hicra", "maxrl_gtpo_sepa"])
def test_a_token_varying_algorithm_is_refused_by_an_aggregating_backend(name):
    with pytest.raises(
        ConfigError,
        match=rf"algorithm '{name}' cannot run on backend 'prime_rl'.*"
        r"preserves_token_advantages=false",
    ):
        preflight(build(name), PRIME_RL, backend_name="prime_rl")


def test_token_uniform_algorithms_pass_on_an_aggregating_backend():
    for name in ("grpo_none", "maxrl_none", "reinforce_pp_none", "rloo_none"):
        assert not preflight(build(name), PRIME_RL, backend_name="prime_rl").token_varying
    assert not preflight(
        build("grpo_none", f"algorithm._target_={PLUGINS}.RankAlgorithm"),
        CONSERVATIVE_CAPABILITIES,
        backend_name="my_backend",
    ).token_varying


def test_the_surprisal_mask_makes_an_algorithm_token_varying():
    with pytest.raises(ConfigError, match="algorithm 'maxrl_none' cannot run on backend 'prime_rl'"):
        preflight(build("maxrl_none", "algorithm.surprisal_mask_rho=0.2"), PRIME_RL, backend_name="prime_rl")


def test_the_probe_catches_an_algorithm_that_varies_without_declaring_it():
    algorithm = build("grpo_none", f"algorithm._target_={PLUGINS}.UndeclaredVaryingAlgorithm")
    assert preflight(algorithm, LOCAL).token_varying
    with pytest.raises(ConfigError, match="its probe produced advantages that vary across a completion's tokens"):
        preflight(algorithm, PRIME_RL, backend_name="prime_rl")


@pytest.mark.parametrize("uncertainty", ["shannon_entropy", "entropy", f"{PLUGINS}.entropy_gap"])
def test_an_uncertainty_that_needs_entropies_is_refused_where_none_come_back(uncertainty):
    algorithm = build("maxrl_gtpo_sepa", f"algorithm.uncertainty={uncertainty}")
    with pytest.raises(
        ConfigError,
        match=r"algorithm 'maxrl_gtpo_sepa' uses uncertainty .* but backend 'tinker' "
        "cannot return them",
    ):
        preflight(algorithm, TINKER, backend_name="tinker")
    with pytest.raises(ConfigError, match="but inference engine VllmEngine cannot return them"):  # not the backend
        preflight(algorithm, LOCAL, backend_name="local", engine_returns_entropies=False, engine_name="VllmEngine")
    assert preflight(algorithm, LOCAL, backend_name="local", engine_returns_entropies=True).needs_entropies


@pytest.mark.parametrize(
    "overrides, culprit",
    [
        ([f"algorithm.advantage._target_={PLUGINS}.wrong_shape_advantage"], f"{PLUGINS}.wrong_shape_advantage"),
        ([f"+algorithm.transforms.drop._target_={PLUGINS}.DropLastToken"], f"{PLUGINS}.DropLastToken"),
        ([f"algorithm._target_={PLUGINS}.FlatShapeAlgorithm"], f"{PLUGINS}.FlatShapeAlgorithm"),
    ],
)
def test_a_broken_plugin_fails_preflight_by_name(overrides, culprit):
    with pytest.raises(PluginOutputError, match=culprit):
        preflight(build("maxrl_gtpo_sepa", *overrides), LOCAL)


def test_preflight_leaves_the_algorithms_schedule_untouched():
    algorithm = build("maxrl_gtpo_sepa", "algorithm.sepa.schedule=auto")
    state = algorithm.state_dict()
    preflight(algorithm, LOCAL)
    assert algorithm.state_dict() == state and algorithm.begin_step(400) == {
        "sepa_lambda": 0.0
    }  # the gate is still closed
