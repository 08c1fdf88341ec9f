"""The whole algorithm on a step: every preset against the per-completion oracle, padding, skipping, metrics."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.algorithm.helpers import build, preset_names, run, synthetic_step
from tests.algorithm.reference import token_advantages

SEPA_STEP = 120  # with delay 50 and steps 500: lambda 0.14 once the gate is open


def split(name: str) -> tuple[str, str]:
    for advantage in ("reinforce_pp", "grpo_std", "grpo", "maxrl", "rloo"):
        if name.startswith(advantage + "_"):
            return advantage, name[len(advantage) + 1 :]
    raise ValueError(name)


def oracle(name: str, step: dict, lam: float, **knobs) -> torch.Tensor:
    advantage, transform = split(name)
    mask = step["mask"]
    rows = [row[m].tolist() for row, m in zip(step["logprobs"], mask)]
    plans = [row[m].tolist() for row, m in zip(step["planning"], mask)]
    entropies = [row[m].tolist() for row, m in zip(step["entropies"], mask)] if step["entropies"] is not None else None
    expected = token_advantages(
        advantage=advantage,
        transform=transform,
        rewards=step["rewards"].tolist(),
        logprobs=rows,
        planning=plans,
        entropies=entropies,
        lam=lam,
        **knobs,
    )
    dense = torch.zeros(mask.shape)
    for n, values in enumerate(expected):
        dense[n, : len(values)] = torch.tensor(values)
    return dense


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_matches_the_per_completion_oracle(name):
    algorithm = build(name)
    step = synthetic_step(groups=3, group_size=4, tokens=16, seed=1)
    out = run(algorithm, step, lam_step=SEPA_STEP)
    lam = 0.14 if algorithm.uses_sepa else 0.0
    assert out.metrics["sepa_lambda"] == pytest.approx(lam)
    torch.testing.assert_close(out.token_advantages, oracle(name, step, lam), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, knobs",
    [
        (["algorithm.surprisal_mask_rho=0.3"], {"rho": 0.3}),
        (["algorithm.batch_advantage_norm=true"], {"batch_norm": True}),
        (["algorithm.adv_clip_max=0.8"], {"cap": 0.8}),
        (
            [
                "algorithm.gtpo.beta=0.5",
                "algorithm.hicra.alpha=0.3",
                "algorithm.surprisal_mask_rho=0.5",
                "algorithm.batch_advantage_norm=true",
                "algorithm.adv_clip_max=1.5",
            ],
            {"beta": 0.5, "alpha": 0.3, "rho": 0.5, "batch_norm": True, "cap": 1.5},
        ),
        (["algorithm.uncertainty=pred_var"], {"kind": "predictive_variance"}),
        (["algorithm.uncertainty=shannon_entropy"], {"kind": "shannon_entropy"}),
    ],
)
def test_knobs_change_the_result_exactly_as_the_oracle_says(overrides, knobs):
    algorithm = build("maxrl_gtpo_hicra", *overrides)
    step = synthetic_step(groups=3, group_size=4, tokens=16, seed=2)
    out = run(algorithm, step)
    torch.testing.assert_close(
        out.token_advantages, oracle("maxrl_gtpo_hicra", step, 0.0, **knobs), rtol=1e-4, atol=1e-5
    )


def test_uniform_groups_are_flagged_and_zeroed_unless_batch_normalisation_is_on():
    step = synthetic_step(groups=3, group_size=4, seed=3)
    out = run(build("maxrl_gtpo"), step)
    assert out.group_has_signal.tolist()[:2] == [False, True]
    assert torch.all(out.token_advantages[:4] == 0)
    assert run(build("reinforce_pp_none"), step).group_has_signal.all()
    assert run(build("maxrl_none", "algorithm.batch_advantage_norm=true"), step).group_has_signal.all()


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(["maxrl_gtpo_sepa", "maxrl_gtpo_hicra", "reinforce_pp_gtpo_sepa_amp_c", "rloo_gtpo"]),
    st.integers(0, 10_000),
    st.integers(1, 9),
    st.sampled_from([0.0, 0.25]),
    st.sampled_from([0.0, float("nan"), -3.0, 1e6]),
)
def test_padding_never_changes_a_result(name, seed, extra, rho, garbage):
    algorithm = build(name, f"algorithm.surprisal_mask_rho={rho}")
    step = synthetic_step(groups=2, group_size=3, tokens=10, seed=seed)
    padded = {key: None if value is None else value.clone() for key, value in step.items()}
    rows = step["mask"].shape[0]
    for key, fill in (("logprobs", garbage), ("entropies", abs(garbage)), ("mask", False), ("planning", True)):
        tail = torch.full((rows, extra), fill, dtype=step[key].dtype)
        padded[key] = torch.cat([step[key], tail], dim=1)
    for key in ("logprobs", "entropies"):  # garbage inside the existing padding too
        padded[key][:, :10][~step["mask"]] = garbage
    plain, wide = (
        run(algorithm, step, lam_step=SEPA_STEP),
        run(build(name, f"algorithm.surprisal_mask_rho={rho}"), padded, lam_step=SEPA_STEP),
    )
    torch.testing.assert_close(wide.token_advantages[:, :10], plain.token_advantages, rtol=1e-6, atol=1e-7)
    assert torch.all(wide.token_advantages[:, 10:] == 0)
    # float32 sums over a wider block add in another order: ~1e-5 relative drift in a std is rounding, not padding
    assert wide.metrics == pytest.approx(plain.metrics, rel=1e-4, abs=1e-7)


def test_metrics_report_uncertainty_before_and_after_the_transforms():
    # one group of one completion: execution tokens u = 1, 3 (mean 2, var 1), planning token u = 5
    logprobs = torch.tensor([[-1.0, -5.0, -3.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    planning = torch.tensor([[False, True, False, False]])
    algorithm = build(
        "maxrl_gtpo_sepa",
        "algorithm.sepa.delay_steps=0",
        "algorithm.sepa.steps=1",
        "algorithm.sepa.correct_rate_gate=0",
    )
    assert algorithm.begin_step(5) == {"sepa_lambda": 1.0}
    out = algorithm.compute(torch.tensor([[1.0]]), logprobs, mask, None, planning)
    m = {key: pytest.approx(value, rel=1e-5, abs=1e-5) for key, value in out.metrics.items()}
    assert (m["exec_entropy_mean"], m["exec_entropy_var"], m["plan_entropy_mean"], m["plan_entropy_var"]) == (
        2.0,
        1.0,
        5.0,
        0.0,
    )
    assert (m["surprisal/exec_mean_before"], m["surprisal/exec_var_before"]) == (2.0, 1.0)
    assert (m["surprisal/exec_mean_after"], m["surprisal/exec_var_after"]) == (2.0, 0.0)
    assert (m["surprisal/plan_mean_after"], m["surprisal/exec_count"], m["surprisal/plan_count"]) == (5.0, 2.0, 1.0)
    assert (m["sepa_lambda"], m["sepa_gate_open"]) == (1.0, 1.0)
    assert m["batch_adv_count"] == 0.0  # a group of one has zero advantage


def test_metric_keys_follow_the_uncertainty_kind_and_the_enabled_steps():
    step = synthetic_step(seed=4)
    base = {
        "sepa_lambda",
        "sepa_gate_open",
        "exec_entropy_mean",
        "exec_entropy_var",
        "plan_entropy_mean",
        "plan_entropy_var",
        "batch_adv_mean",
        "batch_adv_std",
        "batch_adv_count",
    }
    per_kind = {"exec_count", "plan_count"} | {
        f"{part}_{stat}_{when}" for part in ("exec", "plan") for stat in ("mean", "var") for when in ("before", "after")
    }
    keys = set(run(build("grpo_none", "algorithm.uncertainty=entropy"), step).metrics)
    assert keys == base | {f"entropy/{k}" for k in per_kind}
    algorithm = build("maxrl_gtpo_hicra", "algorithm.surprisal_mask_rho=0.2", "algorithm.adv_clip_max=1")
    keys = set(run(algorithm, step).metrics)
    assert keys == base | {f"surprisal/{k}" for k in per_kind} | {
        "surprisal_mask_threshold",
        "surprisal_mask_fraction",
        "adv_cap_fraction",
    }


@pytest.mark.parametrize(
    "name, varying, planning, entropies",
    [
        ("grpo_none", False, False, False),
        ("reinforce_pp_none", False, False, False),
        ("maxrl_gtpo", True, False, False),
        ("maxrl_gtpo_hicra", True, True, False),
        ("maxrl_gtpo_sepa", True, True, False),
    ],
)
def test_capabilities_are_derived_from_the_parts(name, varying, planning, entropies):
    algorithm = build(name)
    derived = (algorithm.token_varying, algorithm.needs_planning, algorithm.needs_entropies)
    assert derived == (varying, planning, entropies)
    assert build(name, "algorithm.uncertainty=shannon").needs_entropies
    assert build("maxrl_none", "algorithm.surprisal_mask_rho=0.1").token_varying


def test_bad_inputs_fail_with_a_clear_message():
    algorithm = build("maxrl_gtpo_sepa")
    step = synthetic_step(groups=2, group_size=3)
    algorithm.begin_step(0)
    with pytest.raises(ValueError, match="needs the planning mask"):
        algorithm.compute(step["rewards"], step["logprobs"], step["mask"], None, None)
    with pytest.raises(ValueError, match=r"mask must be \[B\*G=3, T\], got shape \[6, 16\]"):
        algorithm.compute(step["rewards"][:1], step["logprobs"], step["mask"], None, step["planning"])
    with pytest.raises(ValueError, match="logprobs has shape"):
        algorithm.compute(step["rewards"], step["logprobs"][:, :3], step["mask"], None, step["planning"])
    rewards = step["rewards"].clone()
    rewards[0, 0] = float("nan")
    with pytest.raises(ValueError, match="rewards contain non-finite values"):
        algorithm.compute(rewards, step["logprobs"], step["mask"], None, step["planning"])


def test_a_step_as_the_trainer_runs_it_with_the_tiny_models_tokenizer():
    """Decoded completions -> planning mask -> advantages -> JSON metrics and state, no model needed."""
    from transformers import AutoTokenizer

    from retrain.assets import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    texts = [
        "Let me check: 6 * 7 = 42. \\boxed{42}",
        "Hmm, 6 * 7 = 48? Wait let me verify. \\boxed{42}",
        "6 * 7 = 36 \\boxed{36}",
        "Notice that 6 * 7 = 42 \\boxed{42}",
    ]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((4, width), tokenizer.pad_token_id or 0)
    mask = torch.zeros(4, width, dtype=torch.bool)
    for n, row in enumerate(rows):
        ids[n, : len(row)], mask[n, : len(row)] = torch.tensor(row), True
    logprobs = -torch.rand(4, width, generator=torch.Generator().manual_seed(0)) * mask
    algorithm = build(
        "maxrl_gtpo_sepa",
        "algorithm.sepa.correct_rate_gate=0",
        "algorithm.sepa.delay_steps=0",
        "algorithm.sepa.steps=2",
    )
    lam = algorithm.begin_step(1)["sepa_lambda"]
    planning = algorithm.planning_mask(ids, mask, tokenizer)
    assert planning[0, :12].all() and not planning[2].any()  # "Let me check" / a completion without grams
    out = algorithm.compute(torch.tensor([[1.0, 1.0, 0.0, 1.0]]), logprobs, mask, None, planning)
    algorithm.end_step(0.75)
    assert lam == 0.5 and out.group_has_signal.tolist() == [True]
    assert torch.all(out.token_advantages[2][mask[2]] < 0) and torch.all(out.token_advantages[0][mask[0]] > 0)
    record = json.loads(json.dumps({"condition": algorithm.name, **out.metrics}))
    assert record["sepa_lambda"] == 0.5 and record["surprisal/plan_count"] == float(planning.sum())
    assert json.loads(json.dumps(algorithm.state_dict()))["sepa"]["gate_open"] is True
