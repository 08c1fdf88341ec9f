"""conf/algorithm/: the named conditions compose from one file per part, are named from their parts and build
exactly what the original hand-written presets built; documented overrides work; typos fail at compose time."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf.errors import ConfigKeyError, ValidationError

from retrain.algorithm.batch import AdvantageCap, BatchNormalization
from retrain.algorithm.config import Conditions, mode_name
from retrain.algorithm.grams import DEFAULT_GRAMS
from retrain.algorithm.transforms import HICRA, GTPOWeighting, SEPAAmplification, SEPAPooling, SurprisalMask
from retrain.config import config_dir
from tests.algorithm.helpers import build, compose_algorithm, preset_names

ADVANTAGES = ["grpo", "maxrl", "reinforce_pp", "rloo", "grpo_std"]
CONDITIONS = ["grpo_none", "maxrl_none", "maxrl_gtpo", "maxrl_gtpo_hicra", "maxrl_gtpo_sepa"]
ALGORITHM_DIR = Path(config_dir()) / "algorithm"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "advantages.md"
PLUGINS = "tests.plugins.algorithm_plugins"

# The original retrain's six transform modes (docs/migrate-config.md) as the hand-written presets built them before conditions were composed
# (frozen from their Algorithm.describe()): stages as (key, class, arguments), needs_planning, uses_sepa.
GTPO = ("gtpo", GTPOWeighting, {"beta": 0.1})
MODES = {
    "none": ([], False, False),
    "gtpo": ([GTPO], False, False),
    "gtpo_hicra": ([GTPO, ("hicra", HICRA, {"alpha": 0.2})], True, False),
    "gtpo_sepa": ([("sepa", SEPAPooling, {}), GTPO], True, True),
    "gtpo_sepa_amp": ([("sepa", SEPAAmplification, {"floor_at_zero": False}), GTPO], True, True),
    "gtpo_sepa_amp_c": ([("sepa", SEPAAmplification, {"floor_at_zero": True}), GTPO], True, True),
}


def stages(algorithm) -> dict:
    return dict(algorithm.stages)


def parts(algorithm) -> list[tuple[str, type, dict]]:
    return [
        (key, type(t), {k: v for k, v in vars(t).items() if isinstance(v, (int, float, str, bool))})
        for key, t in algorithm.stages
    ]


def test_conditions_are_every_advantage_option_with_every_seed_mode():
    assert preset_names() == sorted(f"{a}_{m}" for a in ADVANTAGES for m in MODES)
    assert set(CONDITIONS) <= set(preset_names())
    assert sorted(p.stem for p in (ALGORITHM_DIR / "advantage").glob("*.yaml")) == sorted(ADVANTAGES)
    assert sorted(p.stem for p in (ALGORITHM_DIR / "transforms").glob("*.yaml")) == [
        "gtpo",
        "hicra",
        "sepa",
        "sepa_amp",
        "sepa_amp_c",
    ]
    assert not list(ALGORITHM_DIR.glob("*.yaml")), "conditions are generated, not written by hand"


@pytest.mark.parametrize("name", preset_names())
def test_each_condition_builds_what_the_seeds_preset_built(name):
    algorithm = build(name)
    advantage = next(a for a in sorted(ADVANTAGES, key=len, reverse=True) if name.startswith(a + "_"))
    mode = name[len(advantage) + 1 :]
    expected, needs_planning, uses_sepa = MODES[mode]
    if advantage == "reinforce_pp":
        expected = [*expected, ("batch_norm", BatchNormalization, {})]
    assert parts(algorithm) == expected
    assert algorithm.describe() == {
        "name": name,
        "label": f"{advantage}+{mode}",
        "advantage": f"retrain.algorithm.advantages.{advantage}",
        "uncertainty": "surprisal",
        "transforms": {key: f"{kind.__module__}.{kind.__name__}" for key, kind, _ in expected},
        "token_varying": mode != "none",
        "needs_planning": needs_planning,
        "needs_entropies": False,
        "uses_sepa": uses_sepa,
        "gtpo": {"beta": 0.1},
        "hicra": {"alpha": 0.2},
    }
    sepa = algorithm.sepa
    assert (sepa.steps, sepa.schedule, sepa.delay_steps, sepa.correct_rate_gate) == (500, "linear", 50, 0.1)


def test_a_condition_with_a_part_swapped_is_named_after_its_parts():
    swapped = compose_algorithm("maxrl_gtpo_sepa", "algorithm/advantage=rloo")
    assert (swapped.name, swapped.label) == ("rloo_gtpo_sepa", "rloo+gtpo_sepa")
    assert build("maxrl_gtpo_sepa", "algorithm/advantage=rloo").describe() == build("rloo_gtpo_sepa").describe()
    added = compose_algorithm("grpo_none", "+algorithm/transforms=hicra")
    assert (added.name, added.label) == ("grpo_hicra", "grpo+hicra")
    assert compose_algorithm("grpo_none", "algorithm/transforms=[sepa_amp_c,gtpo]").name == "grpo_gtpo_sepa_amp_c"
    assert compose_algorithm("maxrl_gtpo_hicra", "algorithm.transforms.hicra=null").name == "maxrl_gtpo"
    amp = compose_algorithm("maxrl_gtpo_sepa_amp", "algorithm.transforms.sepa.floor_at_zero=true")
    assert amp.name == "maxrl_gtpo_sepa_amp_c"
    # hyper-parameters are settings of a part, not what it is
    assert (
        compose_algorithm("maxrl_gtpo", "algorithm.transforms.gtpo.beta=0.3", "algorithm.gtpo.beta=0.2").name
        == "maxrl_gtpo"
    )


def test_an_explicit_name_wins_and_a_users_parts_get_names_of_their_own():
    named = compose_algorithm("maxrl_gtpo_sepa", "algorithm.name=my_run")
    assert (named.name, named.label) == ("my_run", "maxrl+gtpo_sepa")
    plugin = compose_algorithm(
        "maxrl_gtpo",
        f"algorithm.advantage._target_={PLUGINS}.sign_advantage",
        f"+algorithm.transforms.clip._target_={PLUGINS}.ClipAdvantages",
    )
    assert (plugin.name, plugin.label) == ("sign_advantage_gtpo_clip", "sign_advantage+gtpo_clip")


def test_the_list_order_is_the_order_the_transforms_run():
    assert list(stages(build("maxrl_gtpo_sepa"))) == ["sepa", "gtpo"]  # SEPA pools what GTPO then reads
    assert list(stages(build("maxrl_none", "algorithm/transforms=[hicra,gtpo]"))) == ["hicra", "gtpo"]
    assert list(stages(build("maxrl_gtpo_sepa", "+algorithm/transforms=hicra"))) == ["sepa", "gtpo", "hicra"]
    assert stages(build("maxrl_gtpo_sepa", "algorithm/transforms=[]")) == {}


@pytest.mark.parametrize(
    "names, expected",
    [
        ([], "none"),
        (["gtpo"], "gtpo"),
        (["sepa", "gtpo"], "gtpo_sepa"),
        (["gtpo", "hicra"], "gtpo_hicra"),
        (["hicra", "clip"], "hicra_clip"),
        (["clip", "gtpo", "hicra"], "gtpo_clip_hicra"),
    ],
)
def test_the_transform_part_of_a_name_puts_gtpo_first_then_the_rest_in_order(names, expected):
    assert mode_name(names) == expected


def test_a_new_advantage_costs_one_yaml_file(tmp_path):
    algorithm_dir = shutil.copytree(ALGORITHM_DIR, tmp_path / "algorithm")
    (algorithm_dir / "advantage" / "sign.yaml").write_text(f"_target_: {PLUGINS}.sign_advantage\n_partial_: true\n")
    conditions = Conditions(algorithm_dir)
    assert {f"sign_{mode}" for mode in MODES} <= set(conditions.presets())
    assert conditions.presets()["sign_gtpo_sepa"]["defaults"][1:3] == [
        {"advantage": "sign"},
        {"transforms": ["sepa", "gtpo"]},
    ]
    assert conditions.name({"_target_": f"{PLUGINS}.sign_advantage", "_partial_": True}, {}) == "sign_none"


def test_every_preset_is_listed_in_the_docs_and_every_listed_pairing_exists():
    text = DOCS.read_text()
    pattern = rf"`((?:{'|'.join(ADVANTAGES)})_(?:{'|'.join(MODES)}))`"
    assert set(re.findall(pattern, text)) == set(preset_names())


def test_defaults_follow_the_seeds():
    algorithm = build("maxrl_gtpo_hicra")
    parts = stages(algorithm)
    assert (parts["gtpo"].beta, parts["hicra"].alpha, algorithm.uncertainty.name) == (0.1, 0.2, "surprisal")
    sepa = algorithm.sepa
    assert (sepa.steps, sepa.schedule, sepa.delay_steps, sepa.correct_rate_gate) == (500, "linear", 50, 0.1)
    assert algorithm.planning.grams == DEFAULT_GRAMS and len(DEFAULT_GRAMS) == 18


def test_maxrl_gtpo_sepa_is_the_default_algorithm():
    from retrain.config import compose

    assert compose([]).algorithm.name == "maxrl_gtpo_sepa"


def test_documented_overrides_reach_the_parts():
    algorithm = build(
        "maxrl_gtpo_hicra",
        "algorithm.gtpo.beta=0.2",
        "algorithm.hicra.alpha=0.3",
        "algorithm.uncertainty=predictive_variance",
        "algorithm.surprisal_mask_rho=0.2",
        "algorithm.batch_advantage_norm=true",
        "algorithm.adv_clip_max=2.5",
        "algorithm.sepa.schedule=auto",
        "algorithm.sepa.delay_steps=7",
    )
    parts = stages(algorithm)
    assert (parts["gtpo"].beta, parts["hicra"].alpha, parts["surprisal_mask"].rho, parts["adv_cap"].cap) == (
        0.2,
        0.3,
        0.2,
        2.5,
    )
    assert isinstance(parts["surprisal_mask"], SurprisalMask) and isinstance(parts["batch_norm"], BatchNormalization)
    assert list(parts) == ["gtpo", "hicra", "surprisal_mask", "batch_norm", "adv_cap"]
    assert isinstance(parts["adv_cap"], AdvantageCap)
    assert algorithm.uncertainty.name == "predictive_variance"
    assert (algorithm.sepa.schedule, algorithm.sepa.delay_steps) == ("auto", 7)


def test_a_campaign_wide_override_composes_for_presets_without_that_transform():
    assert stages(build("grpo_none", "algorithm.gtpo.beta=0.2", "algorithm.hicra.alpha=0.3")) == {}


def test_a_transform_can_be_switched_off_or_added_by_key():
    assert list(stages(build("maxrl_gtpo_hicra", "algorithm.transforms.hicra=null"))) == ["gtpo"]
    added = build(
        "maxrl_gtpo",
        "+algorithm.transforms.clip._target_=tests.plugins.algorithm_plugins.ClipAdvantages",
        "+algorithm.transforms.clip.limit=0.25",
    )
    assert list(stages(added)) == ["gtpo", "clip"] and stages(added)["clip"].limit == 0.25


@pytest.mark.parametrize(
    "grams, expected",
    [
        ('["wait let me","double check"]', ("wait let me", "double check")),
        ('"wait let me, double   check"', ("wait let me", "double check")),
        ("'[\"notice that\"]'", ("notice that",)),
        ('""', DEFAULT_GRAMS),
    ],
)
def test_planning_grams_take_a_list_a_csv_or_a_json_string(grams, expected):
    assert build("maxrl_gtpo_sepa", f"algorithm.planning.grams={grams}").planning.grams == expected


@pytest.mark.parametrize(
    "override, error",
    [
        ("algorithm.gtpo.betta=0.2", ConfigCompositionException),
        ("algorithm.sepa.schedul=auto", ConfigCompositionException),
        ("algorithm.uncertainty_kind=surprisal", ConfigCompositionException),
        ("algorithm.gtpo.beta=high", ConfigCompositionException),
        ("algorithm.sepa.steps=1.5", ConfigCompositionException),
    ],
)
def test_typos_and_wrong_types_fail_at_compose_time(override, error):
    with pytest.raises(error) as raised:
        compose_algorithm("maxrl_gtpo_sepa", override)
    key = override.split("=")[0]
    cause = raised.value.__cause__
    assert key in str(raised.value) or (cause is not None and isinstance(cause, (ConfigKeyError, ValidationError)))


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.sepa.schedule=cosine", r"algorithm.sepa.schedule='cosine' must be one of \['linear', 'auto'\]"),
        ("algorithm.sepa.correct_rate_gate=1.5", r"algorithm.sepa.correct_rate_gate=1.5 must be in \[0, 1\]"),
        ("algorithm.hicra.alpha=2", r"algorithm.hicra.alpha=2.0 must be in \[0, 1\]"),
        ("algorithm.surprisal_mask_rho=-0.1", "algorithm.surprisal_mask_rho=-0.1 must be >= 0"),
        ("algorithm.adv_clip_max=-1", "algorithm.adv_clip_max=-1.0 must be >= 0"),
        ("algorithm.uncertainty=varentropy", "algorithm.uncertainty='varentropy' is not a known uncertainty kind"),
        ("algorithm.planning.grams=[]", "algorithm.planning.grams=.* must be a non-empty list"),
    ],
)
def test_bad_values_fail_when_built_naming_the_key(override, message):
    with pytest.raises((InstantiationException, ValueError), match=message):
        build("maxrl_gtpo_hicra", override)
