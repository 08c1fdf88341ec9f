"""User plugins through `_target_`: an episode advantage, an uncertainty, a transform, a whole algorithm.

Plugins live in tests/plugins/algorithm_plugins.py; a broken one fails with an error naming it. Our
own parts are trusted by identity, anything else is wrapped and checked, a subclass of ours too.
"""

from __future__ import annotations

import pytest
import torch

from retrain.algorithm import advantages, pipeline, transforms
from retrain.algorithm.base import Algorithm
from retrain.algorithm.checks import check_algorithm_output, checked_algorithm
from retrain.plugins import Checked, PluginOutputError, is_built_in, plugin_name, raised_in_plugin
from tests.algorithm.helpers import build, run, synthetic_step
from tests.algorithm.reference import gtpo
from tests.plugins import algorithm_plugins

PLUGINS = "tests.plugins.algorithm_plugins"


def test_an_episode_advantage_plugin_with_parameters():
    algorithm = build(
        "maxrl_none", f"algorithm.advantage._target_={PLUGINS}.sign_advantage", "+algorithm.advantage.scale=2.0"
    )
    step = synthetic_step(seed=7)
    out = run(algorithm, step)
    rewards = step["rewards"]
    expected = 2.0 * torch.sign(rewards - rewards.mean(dim=1, keepdim=True)) * out.group_has_signal.unsqueeze(1)
    torch.testing.assert_close(out.token_advantages, expected.reshape(-1, 1) * step["mask"])
    assert out.token_advantages.abs().max() == 2.0


def test_a_class_based_advantage_is_built_once_with_its_parameters():
    algorithm = build(
        "grpo_none",
        f"algorithm.advantage._target_={PLUGINS}.ScaledGRPO",
        "algorithm.advantage._partial_=false",
        "+algorithm.advantage.scale=3.0",
    )
    assert isinstance(algorithm.advantage, Checked) and isinstance(
        algorithm.advantage.plugin, algorithm_plugins.ScaledGRPO
    )
    step = synthetic_step(seed=6)
    plain = run(build("grpo_none"), step).token_advantages
    torch.testing.assert_close(run(algorithm, step).token_advantages, 3.0 * plain)


def test_an_uncertainty_plugin_drives_gtpo_and_names_its_metrics():
    algorithm = build("grpo_gtpo", f"algorithm.uncertainty={PLUGINS}.miss_probability")
    step = synthetic_step(seed=8)
    out = run(algorithm, step)
    mask = step["mask"]
    for n in range(mask.shape[0]):
        real = mask[n]
        u = (1.0 - step["logprobs"][n][real].exp()).tolist()
        a = float(out.episode_advantages.reshape(-1)[n])
        torch.testing.assert_close(out.token_advantages[n][real], torch.tensor(gtpo([a] * len(u), u, 0.1)))
    assert "miss/exec_var_before" in out.metrics and "surprisal/exec_var_before" not in out.metrics


def test_a_plugin_uncertainty_is_capped_at_50_like_the_built_in_kinds():
    algorithm = build("grpo_none", f"algorithm.uncertainty={PLUGINS}.surprisal_in_bits_squared")
    logprobs = torch.tensor([[-0.6931471805599453, -20.0]])  # 1 bit -> 1.0; 28.9 bits -> 832, capped
    algorithm.begin_step(0)
    out = algorithm.compute(torch.tensor([[1.0]]), logprobs, torch.ones(1, 2, dtype=torch.bool))
    assert out.metrics["uncertainty/exec_mean_before"] == pytest.approx((1.0 + 50.0) / 2)


def test_transform_plugins_are_added_by_key_after_the_presets_transforms():
    algorithm = build("maxrl_gtpo", f"+algorithm.transforms.clip={{_target_:{PLUGINS}.ClipAdvantages,limit:0.3}}")
    step = synthetic_step(seed=9)
    out = run(algorithm, step)
    unclipped = run(build("maxrl_gtpo"), step).token_advantages
    torch.testing.assert_close(out.token_advantages, unclipped.clamp(-0.3, 0.3))
    assert out.metrics["clip_limit"] == 0.3
    assert list(dict(algorithm.stages)) == ["gtpo", "clip"]


def test_a_function_transform_with_partial_and_no_declarations_counts_as_token_varying():
    algorithm = build(
        "maxrl_none",
        f"+algorithm.transforms.boost={{_target_:{PLUGINS}.boost_opening,_partial_:true,tokens:2,factor:3.0}}",
    )
    assert algorithm.token_varying and not build("maxrl_none").token_varying
    assert not build("maxrl_none", f"+algorithm.transforms.clip={{_target_:{PLUGINS}.ClipAdvantages}}").token_varying
    step = synthetic_step(seed=10)
    out = run(algorithm, step)
    base = run(build("maxrl_none"), step).token_advantages
    torch.testing.assert_close(out.token_advantages[:, :2], 3.0 * base[:, :2])
    torch.testing.assert_close(out.token_advantages[:, 2:], base[:, 2:])


def test_built_in_parts_are_known_by_identity_not_by_module():
    assert is_built_in(advantages.maxrl) and is_built_in(transforms.GTPOWeighting(beta=0.1))
    assert is_built_in(build("maxrl_gtpo")) and isinstance(checked_algorithm(build("maxrl_gtpo")), pipeline.Algorithm)
    assert not is_built_in(algorithm_plugins.SubclassedPipeline)  # defined by a user, subclassing ours
    algorithm = build("maxrl_gtpo", f"+algorithm.transforms.clip={{_target_:{PLUGINS}.ClipAdvantages}}")
    assert [type(t) is Checked for _, t in algorithm.stages] == [False, True]
    assert plugin_name(algorithm.stages[1][1]) == f"{PLUGINS}.ClipAdvantages"
    assert algorithm.stages[1][1].token_varying is False  # declarations reach through the wrapper


def test_a_whole_algorithm_plugin_replaces_the_pipeline():
    algorithm = build("maxrl_gtpo_sepa", f"algorithm._target_={PLUGINS}.RankAlgorithm")
    assert isinstance(algorithm, algorithm_plugins.RankAlgorithm) and algorithm.name == "maxrl_gtpo_sepa"
    assert isinstance(checked_algorithm(algorithm), Algorithm)
    step = synthetic_step(groups=2, group_size=4, seed=11)
    out = run(algorithm, step)
    check_algorithm_output(algorithm, out, 2, step["mask"])
    algorithm.end_step(0.5)
    assert algorithm.state_dict() == {"steps_done": 1}
    ranks = out.token_advantages[:, 0].reshape(2, 4)
    assert torch.equal(ranks.sum(dim=1), torch.zeros(2))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [f"algorithm.advantage._target_={PLUGINS}.wrong_shape_advantage"],
            rf"episode advantage {PLUGINS}.wrong_shape_advantage returned shape \[3\], expected \[3, 4\]",
        ),
        (
            [f"algorithm.advantage._target_={PLUGINS}.nan_advantage"],
            rf"episode advantage {PLUGINS}.nan_advantage returned non-finite values \(e.g. nan at index \[0, 0\]\)",
        ),
        (
            [f"algorithm.advantage._target_={PLUGINS}.float64_overflow_advantage"],
            rf"episode advantage {PLUGINS}.float64_overflow_advantage returned non-finite values \(e.g. (-)?inf ",
        ),
        (
            [f"algorithm.uncertainty={PLUGINS}.nan_uncertainty"],
            rf"uncertainty '{PLUGINS}.nan_uncertainty' returned non-finite values",
        ),
        (
            [f"+algorithm.transforms.drop={{_target_:{PLUGINS}.DropLastToken}}"],
            rf"transform algorithm.transforms.drop \({PLUGINS}.DropLastToken\) \(advantages\) returned shape \[12, 15\], "
            r"expected \[12, 16\]",
        ),
        (
            [f"+algorithm.transforms.inf={{_target_:{PLUGINS}.InfiniteUncertainty}}"],
            rf"transform algorithm.transforms.inf \({PLUGINS}.InfiniteUncertainty\) \(uncertainty\) returned non-finite",
        ),
    ],
)
def test_a_broken_plugin_is_named_in_the_error(overrides, message):
    algorithm = build("maxrl_gtpo", *overrides)
    with pytest.raises(PluginOutputError, match=message):
        run(algorithm, synthetic_step(groups=3, group_size=4, tokens=16, seed=12))


@pytest.mark.parametrize(
    ("override", "error", "named"),
    [
        (f"algorithm.advantage._target_={PLUGINS}.failing_advantage", IndexError, f"episode advantage {PLUGINS}."),
        (f"+algorithm.transforms.bad={{_target_:{PLUGINS}.FailingTransform}}", KeyError, "transform algorithm.trans"),
    ],
)
def test_an_exception_out_of_a_plugin_keeps_its_type_and_names_the_plugin(override, error, named):
    algorithm = build("maxrl_gtpo", override)
    with pytest.raises(error) as raised:
        run(algorithm, synthetic_step(groups=3, group_size=4, tokens=16, seed=12))
    plugin = raised_in_plugin(raised.value)
    assert plugin is not None and plugin.startswith(named), plugin


def test_a_plugin_inside_a_plugin_is_named_not_the_outer_one():
    inner = Checked(algorithm_plugins.failing_advantage, {"__call__": lambda out, *_: out}, "inner")
    outer = Checked(lambda rewards: inner(rewards), {"__call__": lambda out, *_: out}, "outer")
    with pytest.raises(IndexError) as raised:
        outer(torch.zeros(2, 4))
    assert raised_in_plugin(raised.value) == "inner"


def test_a_broken_whole_algorithm_is_named_when_its_output_is_checked():
    algorithm = build("grpo_none", f"algorithm._target_={PLUGINS}.FlatShapeAlgorithm")
    step = synthetic_step(groups=2, group_size=4, seed=13)
    with pytest.raises(
        PluginOutputError,
        match=rf"algorithm 'grpo_none' \({PLUGINS}.FlatShapeAlgorithm\).compute "
        r"\(token_advantages\) returned shape \[8\], expected \[8, 16\]",
    ):
        check_algorithm_output(algorithm, run(algorithm, step), 2, step["mask"])


@pytest.mark.parametrize("plugin", ["FlatShapeAlgorithm", "SubclassedPipeline"])
def test_every_whole_algorithm_plugin_is_checked_where_it_is_built_a_subclass_of_ours_too(plugin):
    algorithm = checked_algorithm(build("grpo_none", f"algorithm._target_={PLUGINS}.{plugin}"))
    assert isinstance(algorithm, Checked) and algorithm.name == "grpo_none" and not algorithm.needs_planning
    step = synthetic_step(groups=2, group_size=4, seed=13)
    with pytest.raises(
        PluginOutputError,
        match=rf"algorithm 'grpo_none' \({PLUGINS}.{plugin}\).compute "
        r"\(token_advantages\) returned shape \[8\], expected \[8, 16\]",
    ):
        run(algorithm, step)


def test_an_algorithm_plugin_without_the_interface_is_refused_by_name():
    with pytest.raises(ValueError, match=rf"{PLUGINS}.sign_advantage\) has no `name`"):
        checked_algorithm(algorithm_plugins.sign_advantage)


def test_a_users_own_preset_extends_a_builtin_one_through_the_search_path(tmp_path):
    (tmp_path / "algorithm").mkdir()
    (tmp_path / "algorithm" / "maxrl_gtpo_clip.yaml").write_text(
        "defaults:\n  - maxrl_gtpo\n  - _self_\nname: maxrl_gtpo_clip\nlabel: maxrl+gtpo_clip\n"
        f"transforms:\n  clip:\n    _target_: {PLUGINS}.ClipAdvantages\n    limit: 0.3\n"
    )
    algorithm = build("maxrl_gtpo_clip", f"hydra.searchpath=[file://{tmp_path}]")
    assert (algorithm.name, algorithm.label, list(dict(algorithm.stages))) == (
        "maxrl_gtpo_clip",
        "maxrl+gtpo_clip",
        ["gtpo", "clip"],
    )


def test_a_whole_algorithm_plugin_reports_step_metrics_from_begin_step_held_to_finite_numbers():
    algorithm = checked_algorithm(build("grpo_none", f"algorithm._target_={PLUGINS}.RankAlgorithm"))
    assert algorithm.begin_step(0) == {}
    algorithm.plugin.begin_step = lambda step: 0.5  # the old protocol's bare lambda is refused, not logged
    with pytest.raises(PluginOutputError, match=r"begin_step returned 0.5, expected a dict of metric names"):
        algorithm.begin_step(1)
    algorithm.plugin.begin_step = lambda step: {"my_schedule": float("nan")}
    with pytest.raises(PluginOutputError, match=r"begin_step returned \{'my_schedule': nan\}"):
        algorithm.begin_step(2)
