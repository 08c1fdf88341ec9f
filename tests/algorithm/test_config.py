"""conf/algorithm/: every preset composes and builds; documented overrides work; typos fail at compose time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf.errors import ConfigKeyError, ValidationError

from retrain.algorithm.batch import AdvantageCap, BatchNormalization
from retrain.algorithm.grams import DEFAULT_GRAMS
from retrain.algorithm.transforms import HICRA, GTPOWeighting, SEPAAmplification, SEPAPooling, SurprisalMask
from tests.algorithm.helpers import CONF_DIR, build, compose_algorithm, preset_names

ADVANTAGES = ["grpo", "maxrl", "reinforce_pp", "rloo", "grpo_std"]
TRANSFORMS = ["none", "gtpo", "gtpo_hicra", "gtpo_sepa", "gtpo_sepa_amp", "gtpo_sepa_amp_c"]
CONDITIONS = ["grpo_none", "maxrl_none", "maxrl_gtpo", "maxrl_gtpo_hicra", "maxrl_gtpo_sepa"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "advantages.md"


def stages(algorithm) -> dict:
    return dict(algorithm.stages)


def test_presets_are_every_advantage_with_every_transform():
    assert preset_names() == sorted(f"{a}_{t}" for a in ADVANTAGES for t in TRANSFORMS)
    assert set(CONDITIONS) <= set(preset_names())
    assert sorted(p.stem for p in (CONF_DIR / "algorithm" / "advantage").glob("*.yaml")) == sorted(ADVANTAGES)
    assert sorted(p.stem for p in (CONF_DIR / "algorithm" / "transform").glob("*.yaml")) == sorted(TRANSFORMS)


@pytest.mark.parametrize("name", preset_names())
def test_each_preset_builds_with_its_name_label_and_parts(name):
    algorithm = build(name)
    advantage = next(a for a in sorted(ADVANTAGES, key=len, reverse=True) if name.startswith(a + "_"))
    transform = name[len(advantage) + 1:]
    assert (algorithm.name, algorithm.label) == (name, f"{advantage}+{transform}")
    assert algorithm.describe()["advantage"] == f"retrain.algorithm.advantages.{advantage}"
    kinds = [type(t) for t in stages(algorithm).values()]
    expected = {"none": [], "gtpo": [GTPOWeighting], "gtpo_hicra": [GTPOWeighting, HICRA],
                "gtpo_sepa": [SEPAPooling, GTPOWeighting], "gtpo_sepa_amp": [SEPAAmplification, GTPOWeighting],
                "gtpo_sepa_amp_c": [SEPAAmplification, GTPOWeighting]}[transform]
    assert kinds == expected + ([BatchNormalization] if advantage == "reinforce_pp" else [])


def test_every_preset_is_listed_in_the_docs_and_every_listed_pairing_exists():
    text = DOCS.read_text()
    pattern = rf"`((?:{'|'.join(ADVANTAGES)})_(?:{'|'.join(TRANSFORMS)}))`"
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
    algorithm = build("maxrl_gtpo_hicra", "algorithm.gtpo.beta=0.2", "algorithm.hicra.alpha=0.3",
                      "algorithm.uncertainty=predictive_variance", "algorithm.surprisal_mask_rho=0.2",
                      "algorithm.batch_advantage_norm=true", "algorithm.adv_clip_max=2.5",
                      "algorithm.sepa.schedule=auto", "algorithm.sepa.delay_steps=7")
    parts = stages(algorithm)
    assert (parts["gtpo"].beta, parts["hicra"].alpha, parts["surprisal_mask"].rho, parts["adv_cap"].cap) == \
        (0.2, 0.3, 0.2, 2.5)
    assert isinstance(parts["surprisal_mask"], SurprisalMask) and isinstance(parts["batch_norm"], BatchNormalization)
    assert list(parts) == ["gtpo", "hicra", "surprisal_mask", "batch_norm", "adv_cap"]
    assert isinstance(parts["adv_cap"], AdvantageCap)
    assert algorithm.uncertainty.name == "predictive_variance"
    assert (algorithm.sepa.schedule, algorithm.sepa.delay_steps) == ("auto", 7)


def test_a_campaign_wide_override_composes_for_presets_without_that_transform():
    assert stages(build("grpo_none", "algorithm.gtpo.beta=0.2", "algorithm.hicra.alpha=0.3")) == {}


def test_a_transform_can_be_switched_off_or_added_by_key():
    assert list(stages(build("maxrl_gtpo_hicra", "algorithm.transforms.hicra=null"))) == ["gtpo"]
    added = build("maxrl_gtpo", "+algorithm.transforms.clip._target_=tests.plugins.algorithm_plugins.ClipAdvantages",
                  "+algorithm.transforms.clip.limit=0.25")
    assert list(stages(added)) == ["gtpo", "clip"] and stages(added)["clip"].limit == 0.25


@pytest.mark.parametrize("grams, expected", [
    ('["wait let me","double check"]', ("wait let me", "double check")),
    ('"wait let me, double   check"', ("wait let me", "double check")),
    ("'[\"notice that\"]'", ("notice that",)),
    ('""', DEFAULT_GRAMS),
])
def test_planning_grams_take_a_list_a_csv_or_a_json_string(grams, expected):
    assert build("maxrl_gtpo_sepa", f"algorithm.planning.grams={grams}").planning.grams == expected


@pytest.mark.parametrize("override, error", [
    ("algorithm.gtpo.betta=0.2", ConfigCompositionException),
    ("algorithm.sepa.schedul=auto", ConfigCompositionException),
    ("algorithm.uncertainty_kind=surprisal", ConfigCompositionException),
    ("algorithm.gtpo.beta=high", ConfigCompositionException),
    ("algorithm.sepa.steps=1.5", ConfigCompositionException),
])
def test_typos_and_wrong_types_fail_at_compose_time(override, error):
    with pytest.raises(error) as raised:
        compose_algorithm("maxrl_gtpo_sepa", override)
    key = override.split("=")[0]
    cause = raised.value.__cause__
    assert key in str(raised.value) or (cause is not None and isinstance(cause, (ConfigKeyError, ValidationError)))


@pytest.mark.parametrize("override, message", [
    ("algorithm.sepa.schedule=cosine", r"algorithm.sepa.schedule='cosine' must be one of \['linear', 'auto'\]"),
    ("algorithm.sepa.correct_rate_gate=1.5", r"algorithm.sepa.correct_rate_gate=1.5 must be in \[0, 1\]"),
    ("algorithm.hicra.alpha=2", r"algorithm.hicra.alpha=2.0 must be in \[0, 1\]"),
    ("algorithm.surprisal_mask_rho=-0.1", "algorithm.surprisal_mask_rho=-0.1 must be >= 0"),
    ("algorithm.adv_clip_max=-1", "algorithm.adv_clip_max=-1.0 must be >= 0"),
    ("algorithm.uncertainty=varentropy", "algorithm.uncertainty='varentropy' is not a known uncertainty kind"),
    ("algorithm.planning.grams=[]", "algorithm.planning.grams=.* must be a non-empty list"),
])
def test_bad_values_fail_when_built_naming_the_key(override, message):
    with pytest.raises((InstantiationException, ValueError), match=message):
        build("maxrl_gtpo_hicra", override)
