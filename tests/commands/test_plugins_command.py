"""`retrain plugins`: built-in options of every group and the user's own, each with its `_target_`s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retrain.commands.plugins import main
from retrain.config import config_groups


def listing(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def by_option(parts: list[dict]) -> dict[tuple[str, str], list[str]]:
    return {(part["group"], part["option"]): part["targets"] for part in parts}


def test_every_builtin_option_of_every_group_with_its_targets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./conf here
    result = listing(capsys)
    builtin = by_option(result["builtin"])
    assert set(builtin) == {(group, option) for group, options in config_groups().items() for option in options}
    assert builtin[("backend", "local")] == ["retrain.backend.local.LocalBackend"]
    assert builtin[("algorithm/transforms", "gtpo")] == ["retrain.algorithm.transforms.GTPOWeighting"]
    condition = builtin[("algorithm", "grpo_gtpo_hicra")]  # a generated condition: the pipeline and its parts
    assert {
        "retrain.algorithm.pipeline.Algorithm",
        "retrain.algorithm.advantages.grpo",
        "retrain.algorithm.transforms.GTPOWeighting",
        "retrain.algorithm.transforms.HICRA",
    } <= set(condition)
    assert "retrain.algorithm.transforms.SEPAPooling" not in condition
    assert result["user"] == {}


def test_user_options_in_conf_and_config_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf" / "reward").mkdir(parents=True)
    (tmp_path / "conf" / "reward" / "mine.yaml").write_text("_target_: my_module.score\n_partial_: true\n")
    (tmp_path / "conf" / "reward" / "match.yaml").write_text("_target_: my_module.other\n")
    extra = tmp_path / "more" / "backend"
    extra.mkdir(parents=True)
    (extra / "remote.yaml").write_text("defaults:\n  - base_local\n  - _self_\n_target_: my_module.Remote\n")
    user = listing(capsys, "--config-dir", str(tmp_path / "more"))["user"]
    assert set(user) == {str(tmp_path / "more"), "conf"}
    mine = {part["option"]: part for part in user["conf"]}
    assert mine["mine"]["targets"] == ["my_module.score"] and "shadowed_by_builtin" not in mine["mine"]
    assert mine["match"]["shadowed_by_builtin"]  # Hydra finds retrain's reward=match first
    # its own `_target_` replaces the one its defaults list brings in
    assert by_option(user[str(tmp_path / "more")]) == {("backend", "remote"): ["my_module.Remote"]}
    assert main([]) == 0
    text = capsys.readouterr().out
    assert "my_module.score" in text and "hidden by the built-in option" in text


def test_a_missing_config_dir_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--config-dir", str(tmp_path / "nowhere")])
    assert refused.value.code == 1 and "nowhere is not a directory" in capsys.readouterr().err
