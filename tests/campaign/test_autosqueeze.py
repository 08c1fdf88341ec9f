"""Auto-squeeze of the first finished run: squeeze.json once, optional compression, wandb table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from peft import PeftModel

from retrain.campaign.autosqueeze import squeeze_first_finished, squeeze_settings
from retrain.housekeeping.rundir import RunDir
from retrain.squeeze import SqueezeError
from tests.test_squeeze import save_adapter, tiny_base


def campaign_config(**squeeze: object) -> object:
    return OmegaConf.create(
        {"squeeze": squeeze, "logging": {"wandb_project": "", "wandb_entity": "", "wandb_group": "grpo_none"}}
    )


def test_first_finished_run_is_squeezed_once_and_compressed_in_the_sweep(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    first, second = RunDir(sweep_dir / "grpo_none_s1"), RunDir(sweep_dir / "grpo_none_s2")
    save_adapter(first.final_dir)
    save_adapter(second.final_dir)
    config = campaign_config(min_variance_retention=0.9, output_dir="squeezed", compress_to=2)
    settings = squeeze_settings(config)
    payload = squeeze_first_finished(sweep_dir, first, settings, config)
    assert payload is not None and payload["run"] == "grpo_none_s1"
    assert squeeze_first_finished(sweep_dir, second, settings, config) is None  # only the first one
    stored = json.loads((sweep_dir / "squeeze.json").read_text())
    assert stored["report"]["recommended_rank"] == payload["report"]["recommended_rank"]
    assert "| rank | mean variance retained |" in stored["table"]
    assert stored["compressed"] == str(sweep_dir / "squeezed")
    assert PeftModel.from_pretrained(tiny_base(), str(sweep_dir / "squeezed")).peft_config["default"].r == 2


def test_the_table_goes_to_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = RunDir(tmp_path / "sweep" / "maxrl_gtpo_sepa_s42")
    save_adapter(run_dir.final_dir)
    config = campaign_config(min_variance_retention=0.95)
    config.logging.wandb_project = "retrain-tests"
    payload = squeeze_first_finished(tmp_path / "sweep", run_dir, squeeze_settings(config), config)
    tables = list(run_dir.path.glob("wandb/offline-run-*/files/media/table/squeeze/variance_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["rank", "mean_variance_retained", "worst_module"]
    ranks = payload["report"]["target_ranks"]
    assert [row[0] for row in table["data"]] == ranks
    assert [row[1] for row in table["data"]] == pytest.approx(
        [payload["report"]["mean_retention"][str(k)] for k in ranks]
    )


def test_bad_squeeze_settings_name_the_key() -> None:
    with pytest.raises(SqueezeError, match=r"unknown key\(s\) \['min_variance'\]"):
        squeeze_settings(campaign_config(min_variance=0.9))
    assert squeeze_settings(OmegaConf.create({"squeeze": None})) is None
