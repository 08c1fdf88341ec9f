"""summary.json and summary.md of a sweep: per-condition scores across seeds and their tests.

Only finished (`done`) runs enter the statistics, so a number never mixes complete and partial
runs; every other run is listed with its state and error, so a failure is visible, never hidden.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from retrain.campaign.held_out import KINDS, HeldOut, condition_held_out, held_out
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


def condition_rows(
    campaign: Campaign, scores: dict[str, RunScores], held: dict[str, HeldOut]
) -> tuple[str | None, list[dict[str, Any]]]:
    """Per condition: estimates over its done seeds, pooled counts, and tests against its baseline; the same
    for its held-out accuracy (retrain.campaign.held_out)."""
    settings = campaign.settings
    conditions = campaign.conditions
    done = {c: [r for r in campaign.runs if r.condition == c and r.state == "done"] for c in conditions}
    references = baselines(campaign)
    baseline = settings.baseline if baseline_declared(campaign) else (conditions[0] if conditions else None)
    rows = []
    for condition in conditions:
        own = [scores[r.name] for r in done[condition]]
        correct, total = sum(s.correct for s in own), sum(s.total for s in own)
        reference = references[condition]
        row: dict[str, Any] = {
            "condition": condition,
            "baseline": reference,
            "is_baseline": reference == condition,
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
        base_runs = done[reference] if reference is not None and reference != condition else None
        row["held_out"] = condition_held_out(
            [held[r.name] for r in done[condition]],
            None if base_runs is None else [held[r.name] for r in base_runs],
            settings.confidence,
        )
        if reference is not None and reference != condition:
            base_scores = [scores[r.name] for r in done[reference]]
            row["fisher_vs_baseline"] = fisher_exact(
                correct, total, sum(s.correct for s in base_scores), sum(s.total for s in base_scores)
            ).to_json()
            row["welch_vs_baseline"] = welch_t([s.last_k for s in own], [s.last_k for s in base_scores]).to_json()
        rows.append(row)
    return baseline, rows


def _parts(campaign: Campaign) -> dict[str, tuple[str | None, dict[str, str]]]:
    """Each condition's (algorithm, other swept settings)."""
    parts: dict[str, tuple[str | None, dict[str, str]]] = {}
    for run in campaign.runs:
        if run.condition and run.condition not in parts:
            parts[run.condition] = (run.algorithm or run.condition, run.settings)
    return parts


def baselines(campaign: Campaign) -> dict[str, str | None]:
    """The condition each condition is tested against: like with like, the one that differs from it in the
    algorithm only — the configured baseline's (`hydra.callbacks.campaign.baseline`) with the same other
    swept settings. A baseline naming a whole condition (`grpo_std_none recipe=grpo`: a sweep of settings, not
    of algorithms) is every condition's. A sweep without the configured baseline tests against its first condition
    of the same settings, else its first condition. None where the configured baseline ran, but not with these
    settings."""
    parts = _parts(campaign)
    wanted = campaign.settings.baseline
    if wanted in parts:
        return dict.fromkeys(parts, wanted)
    declared = baseline_declared(campaign)
    first = next(iter(parts), None)
    references: dict[str, str | None] = {}
    for condition, (_, settings) in parts.items():
        same = [other for other, (_, its) in parts.items() if its == settings]
        if declared:
            references[condition] = next((other for other in same if parts[other][0] == wanted), None)
        else:
            references[condition] = same[0] if len(same) > 1 else first
    return references


def baseline_declared(campaign: Campaign) -> bool:
    """Whether the configured baseline (an algorithm, or a whole condition) was planned or ran: then it stays the
    baseline even when none of its runs reads (another condition in its place would test every condition against
    the wrong reference)."""
    wanted = campaign.settings.baseline
    planned = {job.condition for job in campaign.plan or []}
    parts = _parts(campaign)
    return wanted in planned or wanted in parts or any(algorithm == wanted for algorithm, _ in parts.values())


def baseline_note(campaign: Campaign) -> str | None:
    """Why no condition is tested against the baseline, when it was planned but none of its runs reads."""
    wanted = campaign.settings.baseline
    parts = _parts(campaign)
    if (
        not baseline_declared(campaign)
        or wanted in parts
        or any(algorithm == wanted for algorithm, _ in parts.values())
    ):
        return None
    return f"the baseline `{wanted}` has no readable run: no condition is tested against it"


def entropy_comparison(campaign: Campaign, scores: dict[str, RunScores]) -> dict[str, Any] | None:
    """SEPA vs HICRA (by default): execution-token entropy variance over the last k steps, per seed; the
    first pair of conditions with these algorithms and the same other swept settings."""
    wanted = campaign.settings.entropy_pair
    parts = _parts(campaign)
    pair = next(
        (
            (first, second)
            for first, (algorithm, settings) in parts.items()
            if algorithm == wanted[0]
            for second, (other, its) in parts.items()
            if other == wanted[1] and its == settings
        ),
        None,
    )
    if pair is None:
        return None
    first, second = pair
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


def build_summary(campaign: Campaign, plot: str | None, held_out_plot: str | None = None) -> dict[str, Any]:
    """`plot`, `held_out_plot`: the file names of the learning curves and the held-out accuracy plot, if drawn."""
    scores = _scores(campaign)
    held = {run.name: held_out(run) for run in campaign.runs}
    baseline, rows = condition_rows(campaign, scores, held)
    return {
        "sweep_dir": str(campaign.sweep_dir),
        "state": campaign.state,
        "generated_at": time.time(),
        "settings": asdict(campaign.settings),
        "baseline": baseline,
        "baseline_note": baseline_note(campaign),
        "counts": state_counts(campaign.runs),
        "conditions": rows,
        "entropy_comparison": entropy_comparison(campaign, scores),
        "runs": [_run_row(run, scores[run.name], held[run.name]) for run in campaign.runs],
        "failed": [
            {"name": r.name, "state": r.state, "error": r.error, "dir": None if r.dir is None else str(r.dir)}
            for r in campaign.runs
            if r.state in ("failed", "dead", "missing", "unreadable")
        ],
        "squeeze": campaign.squeeze,
        "plot": plot,
        "held_out_plot": held_out_plot,
    }


def _run_row(run: RunInfo, scores: RunScores, held: HeldOut) -> dict[str, Any]:
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
        "held_out_after": held.after,
        "updated_at": run.updated_at,
        "error": run.error,
        "has_adapter": run.has_adapter,
        "dir": None if run.dir is None else str(run.dir),
    }


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _estimate_text(data: dict[str, Any]) -> str:
    return Estimate(**data).text()


def _test_text(row: dict[str, Any], result: dict[str, Any] | None, name: str) -> str:
    """`result`: a test of the condition `row` against its baseline."""
    if row["is_baseline"]:
        return "(baseline)"
    if row["baseline"] is None or result is None:
        return "— (no baseline with the same settings)"
    return TestResult(**result).text(name)


def _held_out_lines(summary: dict[str, Any]) -> list[str]:
    """The held-out accuracy section: before/after/gain per condition and kind, and each eval point."""
    level = round(100 * summary["settings"]["confidence"])
    rows = [
        (row, kind, figures) for row in summary["conditions"] for kind, figures in (row.get("held_out") or {}).items()
    ]
    if not rows:
        return []
    lines = [
        "",
        "## Held-out accuracy",
        "",
        "Problems the runs never train on (`eval.*`), greedy and sampled: *before* and *after* training, "
        f"*gain* = after − before of each seed; mean ± std [{level}% t-interval] over finished seeds.",
        "",
        "| condition | kind | before | after | gain | Welch vs baseline (after) |",
        "|---|---|---|---|---|---|",
    ]
    for row, kind, figures in rows:
        lines.append(
            f"| `{row['condition']}` | {kind} | {_estimate_text(figures['before'])} "
            f"| {_estimate_text(figures['after'])} | {_estimate_text(figures['gain'])} "
            f"| {_test_text(row, figures['welch_vs_baseline'], 't')} |"
        )
    steps = sorted({point["step"] for _, _, figures in rows for point in figures["points"]})
    if steps:
        lines += [
            "",
            "During training (`eval.every`), at the step of the metrics record that holds each measurement:",
            "",
            "| condition | kind | " + " | ".join(f"step {step}" for step in steps) + " |",
            "|---|---|" + "---|" * len(steps),
        ]
        for row, kind, figures in rows:
            at = {point["step"]: point for point in figures["points"]}
            cells = [
                _estimate_text({k: v for k, v in at[step].items() if k != "step"}) if step in at else "—"
                for step in steps
            ]
            lines.append(f"| `{row['condition']}` | {kind} | " + " | ".join(cells) + " |")
    if summary.get("held_out_plot"):
        lines += ["", f"![held-out accuracy]({summary['held_out_plot']})"]
    return lines


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
        "- a condition is every swept setting but the seed; each is tested against the baseline that has "
        "its other settings",
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
            f"| {_estimate_text(row['last_k'])} | {pooled_text} | {_test_text(row, row['fisher_vs_baseline'], 'OR')} "
            f"| {_test_text(row, row['welch_vs_baseline'], 't')} |"
        )
    lines += _held_out_lines(summary)
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
            f"- Welch: {TestResult(**comparison['welch']).text('t')}",
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
        f"| run | state | step | final | last-{k} | {ENTROPY_VAR} | held-out after (greedy/sampled) | updated | error |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for run in summary["runs"]:
        step = f"{run['step'] + 1}/{run['max_steps']}" if run["max_steps"] else str(run["step"] + 1)
        error = (run["error"] or "").replace("|", "\\|").replace("\n", " ")[:160]
        after = run.get("held_out_after") or {}
        held_out_text = "/".join(_num(after.get(kind)) for kind in KINDS) if after else "—"
        lines.append(
            f"| `{run['name']}` | {run['state']} | {step} | {_num(run['final'])} | {_num(run['last_k'])} "
            f"| {_num(run['entropy_var'], 4)} | {held_out_text} | {describe_age(run['updated_at'])} | {error} |"
        )
    if summary["failed"]:
        lines += ["", "## Failed or lost runs", ""]
        lines += [f"- `{f['name']}` ({f['state']}): {f['error'] or 'no error recorded'}" for f in summary["failed"]]
    return "\n".join(lines) + "\n"
