"""Rewrite a sweep's manifest, summary and plot from its files (under the sweep's lock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from retrain.campaign.manifest import Campaign, collect, sweep_lock, write_manifest
from retrain.housekeeping.rundir import write_json_atomic


def write_summary(campaign: Campaign) -> dict[str, Any]:
    # here: every run loads this module (the campaign callback), only a sweep's summary needs matplotlib and scipy
    from retrain.campaign.plots import CURVES_PNG, HELD_OUT_PNG, plot_held_out, plot_learning_curves
    from retrain.campaign.summary import SUMMARY_JSON, SUMMARY_MD, build_summary, render_markdown

    png = plot_learning_curves(
        campaign.runs, campaign.conditions, campaign.sweep_dir / CURVES_PNG, title=campaign.sweep_dir.name
    )
    held_out = plot_held_out(
        campaign.runs, campaign.conditions, campaign.sweep_dir / HELD_OUT_PNG, title=campaign.sweep_dir.name
    )
    summary = build_summary(campaign, plot=png.name if png else None, held_out_plot=held_out.name if held_out else None)
    write_json_atomic(campaign.sweep_dir / SUMMARY_JSON, summary)
    tmp = campaign.sweep_dir / f".{SUMMARY_MD}.tmp"
    tmp.write_text(render_markdown(summary))
    tmp.replace(campaign.sweep_dir / SUMMARY_MD)
    return summary


def refresh(sweep_dir: Path, with_summary: bool = True, driver_exiting: bool = False) -> Campaign:
    """Re-derive everything; `with_summary=False` only rewrites the (cheap) manifest."""
    with sweep_lock(sweep_dir):
        campaign = collect(sweep_dir, driver_exiting)
        write_manifest(campaign)
        if with_summary:
            write_summary(campaign)
    return campaign
