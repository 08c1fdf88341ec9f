"""Auto-squeeze: the first run of a campaign to finish has its adapter analysed (LoRA-Squeeze), so
the rank recommendation is known while the other runs still train.

The result lands in `<sweep>/squeeze.json` (which the manifest and summary.md include) and, when
the campaign logs to wandb, in a `squeeze` run of the same project and group.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from retrain.campaign.manifest import SQUEEZE_FILE
from retrain.config import container_dict
from retrain.housekeeping.rundir import RunDir, write_json_atomic
from retrain.squeeze import SqueezeError, SqueezeReport, SqueezeSettings, run_squeeze

log = logging.getLogger("retrain.campaign")


def squeeze_settings(config: DictConfig) -> SqueezeSettings | None:
    """The `squeeze:` block of the config, validated (an unknown key is named); None when absent."""
    node = config.get("squeeze")
    if node is None:
        return None
    values = container_dict(node, "squeeze") if isinstance(node, DictConfig) else node
    if not isinstance(values, dict):
        raise SqueezeError(f"squeeze: expected a mapping of settings, got {values!r}")
    return SqueezeSettings.from_mapping(values)


def squeeze_first_finished(
    sweep_dir: Path, run_dir: RunDir, settings: SqueezeSettings, config: DictConfig
) -> dict[str, Any] | None:
    """Analyse `run_dir`'s final adapter unless a run already was; call under the sweep lock."""
    target = sweep_dir / SQUEEZE_FILE
    if target.exists():
        return None
    if settings.output_dir and not Path(settings.output_dir).is_absolute():
        settings = replace(settings, output_dir=str(sweep_dir / settings.output_dir))
    run_name = run_dir.path.name
    report, written = run_squeeze(run_dir.final_dir, settings)
    payload = {
        "run": run_name,
        "adapter": str(run_dir.final_dir),
        "settings": asdict(settings),
        "report": report.to_json(),
        "table": report.table(),
        "recommendation": report.recommendation(),
        "compressed": str(written) if written else None,
    }
    write_json_atomic(target, payload)
    log.info("LoRA-Squeeze of %s:\n%s\n%s", run_name, payload["table"], payload["recommendation"])
    if config.logging.get("wandb_project"):
        log_to_wandb(report, run_name, config)
    return payload


def log_to_wandb(report: SqueezeReport, run_name: str, config: DictConfig) -> None:
    """A short `squeeze` run beside the analysed run: the variance table and the recommendation."""
    import wandb

    logging_cfg = config.logging
    run = wandb.init(
        project=logging_cfg.wandb_project,
        entity=logging_cfg.wandb_entity or None,
        group=logging_cfg.wandb_group or None,
        name=f"squeeze_{run_name}",
        job_type="squeeze",
        config={"source_run": run_name, "min_variance_retention": report.min_variance_retention},
        dir=str(Path(report.adapter_dir).parent),
        reinit="finish_previous",
    )
    table = wandb.Table(
        columns=["rank", "mean_variance_retained", "worst_module"],
        data=[[k, report.mean_retention[k], report.min_retention[k]] for k in report.target_ranks],
    )
    run.log({"squeeze/variance": table})
    run.summary.update({"squeeze/recommended_rank": report.recommended_rank, "squeeze/source_rank": report.source_rank})
    run.finish()
