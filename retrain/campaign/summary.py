"""summary.json and summary.md of a sweep: per-condition scores across seeds and their tests.

Only finished (`done`) runs enter the statistics, so a number never mixes complete and partial
runs; every other run is listed with its state and error, so a failure is visible, never hidden.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retrain.campaign.manifest import Campaign, state_counts
from retrain.campaign.runs import RunInfo, describe_age
from retrain.campaign.stats import (
    ENTROPY_VAR,
    Estimate,
    RunScores,
    TestResult,
    estimate,
    fisher_exact,
    run_scores,
    welch_t,
)

SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"


def _scores(campaign: Campaign) -> dict[str, RunScores]:
    k = campaign.settings.last_k
    return {run.name: run_scores(run.metrics, k) for run in campaign.runs}


def condition_rows(campaign: Campaign, scores: dict[str, RunScores]) -> tuple[str | None, list[dict[str, Any]]]:
    """Per condition: estimates over its done seeds, pooled counts, and tests against the baseline."""
    settings = campaign.settings
    conditions = campaign.conditions
    done = {c: [r for r in campaign.runs if r.condition == c and r.state == "done"] for c in conditions}
    baseline = chosen_baseline(campaign)
    base_scores = [scores[r.name] for r in done.get(baseline, [])] if baseline is not None else []
    testable = baseline in conditions  # a planned baseline whose runs all failed to read: nothing to test against
    rows = []
    for condition in conditions:
        own = [scores[r.name] for r in done[condition]]
        correct, total = sum(s.correct for s in own), sum(s.total for s in own)
        row: dict[str, Any] = {
            "condition": condition,
            "is_baseline": condition == baseline,
            "runs": sum(1 for r in campaign.runs if r.condition == condition),
            "done": len(own),
            "seeds_done": [r.seed for r in done[condition]],
            "final": estimate([s.final for s in own], settings.confidence).to_json(),
            "last_k": estimate([s.last_k for s in own], settings.confidence).to_json(),
            "pooled": {"correct": correct, "total": total, "rate": correct / total if total else None},
            "entropy_var": estimate([s.entropy_var for s in own], settings.confidence).to_json(),
            "fisher_vs_baseline": None,
            "welch_vs_baseline": None,
        }
        if condition != baseline and testable:
            row["fisher_vs_baseline"] = fisher_exact(
                correct, total, sum(s.correct for s in base_scores), sum(s.total for s in base_scores)
            ).to_json()
            row["welch_vs_baseline"] = welch_t([s.last_k for s in own], [s.last_k for s in base_scores]).to_json()
        rows.append(row)
    return baseline, rows


def chosen_baseline(campaign: Campaign) -> str | None:
    """The configured baseline when the sweep planned or ran it, else the first condition (docs/campaigns.md).

    A planned baseline stays the baseline even when none of its runs reads: another condition in its
    place would test every condition against the wrong reference.
    """
    planned = {job.condition for job in campaign.plan or []}
    configured = campaign.settings.baseline
    if configured in campaign.conditions or configured in planned:
        return configured
    return campaign.conditions[0] if campaign.conditions else None


def baseline_note(campaign: Campaign, baseline: str | None) -> str | None:
    """Why no condition is tested against the baseline, when none of its runs reads."""
    if baseline is None or baseline in campaign.conditions:
        return None
    return f"the baseline `{baseline}` has no readable run: no condition is tested against it"


def entropy_comparison(campaign: Campaign, scores: dict[str, RunScores]) -> dict[str, Any] | None:
    """SEPA vs HICRA (by default): execution-token entropy variance over the last k steps, per seed."""
    first, second = campaign.settings.entropy_pair
    if first not in campaign.conditions or second not in campaign.conditions:
        return None
    values = {
        c: [scores[r.name].entropy_var for r in campaign.runs if r.condition == c and r.state == "done"]
        for c in (first, second)
    }
    return {
        "metric": ENTROPY_VAR,
        "conditions": [first, second],
        first: estimate(values[first], campaign.settings.confidence).to_json(),
        second: estimate(values[second], campaign.settings.confidence).to_json(),
        "welch": welch_t(values[first], values[second]).to_json(),
    }


def build_summary(campaign: Campaign, plot: str | None) -> dict[str, Any]:
    scores = _scores(campaign)
    baseline, rows = condition_rows(campaign, scores)
    return {
        "sweep_dir": str(campaign.sweep_dir),
        "state": campaign.state,
        "generated_at": time.time(),
        "settings": asdict(campaign.settings),
        "baseline": baseline,
        "baseline_note": baseline_note(campaign, baseline),
        "counts": state_counts(campaign.runs),
        "conditions": rows,
        "entropy_comparison": entropy_comparison(campaign, scores),
        "runs": [_run_row(run, scores[run.name]) for run in campaign.runs],
        "failed": [
            {"name": r.name, "state": r.state, "error": r.error, "dir": None if r.dir is None else str(r.dir)}
            for r in campaign.runs
            if r.state in ("failed", "dead", "missing", "unreadable")
        ],
        "squeeze": campaign.squeeze,
        "plot": plot,
    }


def _run_row(run: RunInfo, scores: RunScores) -> dict[str, Any]:
    return {
        "name": run.name,
        "condition": run.condition,
        "seed": run.seed,
        "state": run.state,
        "step": run.step,
        "max_steps": run.max_steps,
        "final": scores.final,
        "last_k": scores.last_k,
        "entropy_var": scores.entropy_var,
        "updated_at": run.updated_at,
        "error": run.error,
        "has_adapter": run.has_adapter,
        "dir": None if run.dir is None else str(run.dir),
    }


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _estimate_text(data: dict[str, Any]) -> str:
    return Estimate(**data).text()


def _test_text(data: dict[str, Any] | None, name: str, is_baseline: bool = True) -> str:
    if data is None:
        return "(baseline)" if is_baseline else "—"
    return TestResult(**data).text(name)


def render_markdown(summary: dict[str, Any]) -> str:
    settings = summary["settings"]
    k, level = settings["last_k"], round(100 * settings["confidence"])
    counts = ", ".join(f"{n} {state}" for state, n in sorted(summary["counts"].items()))
    lines = [
        f"# Campaign summary: {Path(summary['sweep_dir']).name}",
        "",
        f"- sweep dir: `{summary['sweep_dir']}`",
        f"- state: **{summary['state']}** ({counts or 'no runs'})",
        f"- baseline: `{summary['baseline']}`; scores are `correct_rate`: *final* = last step, "
        f"*last-{k}* = mean of the last {k} steps; mean ± std [{level}% t-interval] over finished seeds",
        *([f"- **{summary['baseline_note']}**"] if summary.get("baseline_note") else []),
        "",
        "## Conditions",
        "",
        f"| condition | done/runs | final | last-{k} | pooled correct/total (last {k}) | Fisher vs baseline "
        f"| Welch vs baseline (last-{k}) |",
        "|---|---:|---|---|---|---|---|",
    ]
    for row in summary["conditions"]:
        pooled = row["pooled"]
        pooled_text = f"{pooled['correct']}/{pooled['total']} ({_num(pooled['rate'])})" if pooled["total"] else "—"
        lines.append(
            f"| `{row['condition']}` | {row['done']}/{row['runs']} | {_estimate_text(row['final'])} "
            f"| {_estimate_text(row['last_k'])} | {pooled_text} "
            f"| {_test_text(row['fisher_vs_baseline'], 'OR', row['is_baseline'])} "
            f"| {_test_text(row['welch_vs_baseline'], 't', row['is_baseline'])} |"
        )
    comparison = summary["entropy_comparison"]
    if comparison is not None:
        first, second = comparison["conditions"]
        lines += [
            "",
            f"## `{comparison['metric']}`: {first} vs {second}",
            "",
            f"Mean over the last {k} steps of each finished seed.",
            "",
            f"- `{first}`: {_estimate_text(comparison[first])}",
            f"- `{second}`: {_estimate_text(comparison[second])}",
            f"- Welch: {_test_text(comparison['welch'], 't')}",
        ]
    if summary["plot"]:
        lines += ["", "## Learning curves", "", f"![learning curves]({summary['plot']})"]
    if summary["squeeze"]:
        squeeze = summary["squeeze"]
        lines += ["", f"## LoRA-Squeeze of `{squeeze['run']}`", "", squeeze["table"], "", squeeze["recommendation"]]
        if squeeze.get("compressed"):
            lines.append(f"Compressed adapter: `{squeeze['compressed']}`")
    lines += [
        "",
        "## Runs",
        "",
        f"| run | state | step | final | last-{k} | {ENTROPY_VAR} | updated | error |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for run in summary["runs"]:
        step = f"{run['step'] + 1}/{run['max_steps']}" if run["max_steps"] else str(run["step"] + 1)
        error = (run["error"] or "").replace("|", "\\|").replace("\n", " ")[:160]
        lines.append(
            f"| `{run['name']}` | {run['state']} | {step} | {_num(run['final'])} | {_num(run['last_k'])} "
            f"| {_num(run['entropy_var'], 4)} | {describe_age(run['updated_at'])} | {error} |"
        )
    if summary["failed"]:
        lines += ["", "## Failed or lost runs", ""]
        lines += [f"- `{f['name']}` ({f['state']}): {f['error'] or 'no error recorded'}" for f in summary["failed"]]
    return "\n".join(lines) + "\n"
