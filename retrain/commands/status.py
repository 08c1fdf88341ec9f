"""`retrain status <dir>`: where a run, a sweep, or a folder of them stands — also while they run.

    retrain status outputs/sweeps/2025-01-01/12-00-00      # a sweep: the campaign summary
    retrain status outputs/sweeps/.../maxrl_gtpo_sepa_s42  # one run
    retrain status outputs                                 # one line per sweep and run found below
    retrain status outputs/runs/... --watch                # refreshed until the run (or sweep) ends

Everything is derived from the files the runs write, and each process's (or SLURM job's) liveness:
a run that says "running" but whose process is gone is reported `dead`. A sweep is `running`,
`done`, `partial` (finished, some runs not done) or `dead` (finished, none done). A run or sweep dir
whose files cannot be read as such is listed as `unreadable`, with the reason, beside the others.
A stopped or dead run's report ends with the command that resumes it in its own dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from retrain.campaign.manifest import MANIFEST, collect, state_counts
from retrain.campaign.report import refresh
from retrain.campaign.runs import UNREADABLE, RunInfo, describe_age, read_run
from retrain.campaign.stats import finite_number, run_scores
from retrain.campaign.summary import build_summary, render_markdown
from retrain.housekeeping.rundir import RunDir, read_text_file
from retrain.housekeeping.secrets import MASK, masked_values

SWEEP_MARKERS = (MANIFEST, "multirun.yaml")
RUNNING = "running"
LAST_K = 10
RESUMABLE = ("stopped", "dead")  # states whose report says how to resume the run
RETRAIN = ("python", "-m", "retrain")


def is_sweep_dir(path: Path) -> bool:
    return any((path / marker).is_file() for marker in SWEEP_MARKERS)


def run_report(run: RunInfo) -> dict[str, Any]:
    scores = run_scores(run.metrics, LAST_K)
    last = run.metrics[-1] if run.metrics else {}
    files = RunDir(run.dir) if run.dir is not None else None
    checkpoints = [p.name for p in reversed(files.step_dirs())] if files is not None else []
    return {
        "dir": str(run.dir),
        "condition": run.condition,
        "seed": run.seed,
        "state": run.state,
        "step": run.step,
        "max_steps": run.max_steps,
        "updated_at": run.updated_at,
        "error": run.error,
        "final_correct_rate": scores.final,
        f"last_{LAST_K}_correct_rate": scores.last_k,
        "running_correct_rate": finite_number(last.get("running_correct_rate")),
        "last_step_time_s": finite_number(last.get("step_time_s")),
        "checkpoints": checkpoints,
        "final_adapter": run.has_adapter,
        "eval": run.eval,
        "job": run.job,
        "resume_command": resume_command(run) if run.state in RESUMABLE else None,
    }


def resume_command(run: RunInfo) -> str | None:
    """The command that resumes a stopped or dead run in its own dir (docs/backends.md, Checkpoint resume): the
    overrides it was started with, from where it was started, and its run dir. None when they were not recorded."""
    if run.dir is None:
        return None
    files = RunDir(run.dir)
    overrides = run.job.get("overrides")
    if not isinstance(overrides, list):
        try:
            overrides = yaml.safe_load(read_text_file(files.hydra_dir / "overrides.yaml"))
        except (OSError, ValueError, yaml.YAMLError):
            return None
    if not isinstance(overrides, list):
        return None
    words = [str(o) for o in overrides if not str(o).lstrip("+~").startswith("hydra.")]
    runtime = _hydra_runtime(files)
    command = shlex.join([*RETRAIN, *_config_options(runtime), *words, f"hydra.run.dir={run.dir}"])
    cwd = runtime.get("cwd")
    return f"cd {shlex.quote(cwd)} && {command}" if isinstance(cwd, str) else command


def _hydra_runtime(files: RunDir) -> dict[str, Any]:
    """`hydra.runtime` of the run's .hydra/hydra.yaml (where it was started, its config sources); {} unread."""
    try:
        runtime = yaml.safe_load(read_text_file(files.hydra_dir / "hydra.yaml"))["hydra"]["runtime"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return {}
    return runtime if isinstance(runtime, dict) else {}


def _config_options(runtime: dict[str, Any]) -> list[str]:
    """`--config-dir DIR` for each config dir the command line added (`retrain init`'s presets live in one)."""
    sources = runtime.get("config_sources")
    return [
        option
        for source in (sources if isinstance(sources, list) else [])
        if isinstance(source, dict) and source.get("provider") == "command-line" and source.get("path")
        for option in ("--config-dir", str(source["path"]))
    ]


def _number(value: Any) -> str:
    """A rate for the text report: three decimals, or `—` when the run recorded none that is a number."""
    number = finite_number(value)
    return "—" if number is None else f"{number:.3f}"


def json_text(value: Any) -> str:
    """`--json` output that every JSON parser reads: a NaN or infinity a run recorded becomes null."""

    def plain(node: Any) -> Any:
        if isinstance(node, float) and not math.isfinite(node):
            return None
        if isinstance(node, dict):
            return {key: plain(item) for key, item in node.items()}
        if isinstance(node, (list, tuple)):
            return [plain(item) for item in node]
        return node

    return json.dumps(plain(value), indent=2, default=str, allow_nan=False)


def render_run(report: dict[str, Any]) -> str:
    step = report["step"] + 1
    progress = f"{step}/{report['max_steps']}" if report["max_steps"] else str(step)
    lines = [
        f"{report['dir']}",
        f"  state: {report['state']}  (steps {progress}, updated {describe_age(report['updated_at'])})",
        f"  condition: {report['condition']}  seed: {report['seed']}",
    ]
    if report["final_correct_rate"] is not None:
        lines.append(
            f"  correct rate: last step {_number(report['final_correct_rate'])}, "
            f"last {LAST_K} steps {_number(report[f'last_{LAST_K}_correct_rate'])}, "
            f"running {_number(report['running_correct_rate'])}"
        )
    if report["last_step_time_s"] is not None:
        lines.append(f"  last step took {report['last_step_time_s']:.2f} s")
    for key, value in sorted(report["eval"].items()):
        lines.append(f"  {key}: {value:.3f}" if isinstance(value, float) else f"  {key}: {value}")
    lines.append(
        f"  checkpoints: {', '.join(report['checkpoints']) or 'none'}; "
        f"final adapter: {'yes' if report['final_adapter'] else 'no'}"
    )
    job = report["job"]
    if job.get("hostname"):
        slurm = job.get("slurm") or {}
        where = f"pid {job.get('pid')} on {job['hostname']}"
        if slurm.get("job_id"):
            where += f", SLURM job {slurm['job_id']} (restarts: {slurm.get('restart_count', '0')})"
        lines.append(f"  process: {where}")
    if report["error"]:
        lines.append(f"  error: {report['error']}")
    if report["resume_command"]:
        lines.append(f"  resume: {report['resume_command']}")
        if MASK in report["resume_command"]:
            lines.append(f"  ({MASK} stands for a secret the run was given: type it in again)")
    return "\n".join(lines)


def overview(root: Path) -> list[dict[str, Any]]:
    """One entry per sweep and per stand-alone run below `root`; one that cannot be read is `unreadable`."""
    entries: list[dict[str, Any]] = []
    for dirpath, dirs, _ in os.walk(root):
        path = Path(dirpath)
        if is_sweep_dir(path):
            entries.append(_sweep_entry(path))
            dirs.clear()
        elif RunDir(path).has_run():
            run = read_run(path)
            entries.append(
                {
                    "kind": "run",
                    "dir": str(path),
                    "state": run.state,
                    "step": run.step,
                    "max_steps": run.max_steps,
                    "condition": run.condition,
                    "seed": run.seed,
                    "error": run.error,
                }
            )
            dirs.clear()
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return entries


def _sweep_entry(path: Path) -> dict[str, Any]:
    try:
        campaign = collect(path)
    except Exception as error:  # a damaged manifest: any failure to read it must not hide the other entries
        return {"kind": "sweep", "dir": str(path), "state": UNREADABLE, "error": f"{type(error).__name__}: {error}"}
    return {"kind": "sweep", "dir": str(path), "state": campaign.state, "counts": state_counts(campaign.runs)}


def render_overview(entries: list[dict[str, Any]]) -> str:
    lines = []
    for entry in entries:
        if entry["state"] == UNREADABLE:
            lines.append(f"{entry['kind']:<6} {UNREADABLE} {entry['dir']}  ({entry['error']})")
        elif entry["kind"] == "sweep":
            counts = ", ".join(f"{n} {s}" for s, n in sorted(entry["counts"].items()))
            lines.append(f"sweep  {entry['state']:<8} {entry['dir']}  ({counts})")
        else:
            lines.append(
                f"run    {entry['state']:<8} {entry['dir']}  ({entry['condition']}, seed {entry['seed']}, "
                f"step {entry['step'] + 1}/{entry['max_steps']})"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="retrain status", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "path",
        type=Path,
        nargs="?",
        default=Path("outputs"),
        help="a run dir, a sweep dir, or a folder holding them (default: outputs)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument(
        "--write", action="store_true", help="sweeps: also rewrite manifest.json, summary.md/json and the plots"
    )
    parser.add_argument(
        "--watch", action="store_true", help="refresh until nothing under the path is running any more (Ctrl-C quits)"
    )
    parser.add_argument("--interval", type=float, default=5.0, help="--watch: seconds between refreshes (default 5)")
    parser.add_argument("--count", type=int, default=0, help="--watch: stop after this many refreshes (0 = no limit)")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    path: Path = args.path
    if not math.isfinite(args.interval) or args.interval <= 0:  # nan and inf parse as floats, and sleep refuses them
        parser.error(f"--interval must be a number of seconds > 0, not {args.interval}")
    if args.count < 0:
        parser.error("--count must be >= 0")
    if not path.is_dir():
        print(f"retrain status: {path} is not a directory", file=sys.stderr)
        return 2
    path = path.resolve()
    if not args.watch:
        code, text, _ = report(path, args.json, args.write)
        print(text, end="", file=sys.stdout if code == 0 else sys.stderr)
        return code
    return watch(path, args.json, args.write, args.interval, args.count)


def report(path: Path, as_json: bool, write: bool) -> tuple[int, str, bool]:
    """(exit code, the text to print, whether anything there is still running) for a run, sweep or folder."""
    if is_sweep_dir(path):
        try:
            campaign = refresh(path) if write else collect(path)
        except (OSError, ValueError, TypeError) as error:  # a damaged manifest.json: say which, never a traceback
            return 1, f"retrain status: {path} is an unreadable sweep dir ({type(error).__name__}: {error})\n", False
        plots = [name if (path / name).is_file() else None for name in ("learning_curves.png", "held_out_accuracy.png")]
        summary = masked_values(build_summary(campaign, plot=plots[0], held_out_plot=plots[1]))
        text = json_text(summary) + "\n" if as_json else render_markdown(summary)
        return 0, text, campaign.state == RUNNING
    if RunDir(path).has_run():
        run = masked_values(run_report(read_run(path)))  # files of older runs may hold a url's credentials
        return 0, (json_text(run) if as_json else render_run(run)) + "\n", run["state"] == RUNNING
    entries = masked_values(overview(path))
    if not entries:
        return 1, f"retrain status: no runs or sweeps under {path}\n", False
    text = json_text(entries) if as_json else render_overview(entries)
    return 0, text + "\n", any(entry["state"] == RUNNING for entry in entries)


def watch(path: Path, as_json: bool, write: bool, interval: float, count: int) -> int:
    """`report` again every `interval` seconds until nothing is running (or `count` refreshes); on a terminal
    each refresh replaces the last, elsewhere (a log, a pipe) they follow each other under a time line."""
    on_terminal = sys.stdout.isatty()
    shown = 0
    try:
        while True:
            code, text, running = report(path, as_json, write)
            shown += 1
            header = f"retrain status {path}  ({time.strftime('%H:%M:%S')}, every {interval:g} s; Ctrl-C quits)\n"
            print(("\x1b[H\x1b[2J" if on_terminal else "") + header + text, end="", flush=True)
            if code != 0 or not running or (count and shown >= count):
                return code
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
