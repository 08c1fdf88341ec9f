"""Rank 0 alone records a data-parallel run's end (exit.json, the sweep's summary): another rank's Hydra job ends too,
and, racing rank 0 for the run dir's lock, it would write them as well."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from retrain.campaign.callbacks import CampaignCallback


@pytest.mark.parametrize("rank", [None, "0", "1"])
def test_only_rank_0_writes_the_job_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str | None) -> None:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)  # one process: no rank in its environment
    else:
        monkeypatch.setenv("RANK", rank)
    config = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path)}, "mode": RunMode.RUN}})
    CampaignCallback().on_job_end(config, JobReturn(status=JobStatus.COMPLETED))
    written = (tmp_path / "exit.json").is_file()
    assert written == (rank != "1")
    if written:
        assert json.loads((tmp_path / "exit.json").read_text())["status"] == "completed"
