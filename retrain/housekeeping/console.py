"""What the console says about where a run lives: its dir at the start, the result at the end, and
after a stop the command that continues it.

Hydra's default run dir is time-stamped, so repeating the command that started a run starts another
one at step 0; the resume command therefore names the run dir (`hydra.run.dir=<dir>`) with the
overrides the run was started with.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

from hydra.core.hydra_config import HydraConfig

from retrain.housekeeping.rundir import RunDir
from retrain.housekeeping.secrets import masked_override

PROGRESS_BAR_CHOICES = ("auto", "true", "false")


def progress_bar_shown(setting: object, stream: TextIO) -> bool:
    """`logging.progress_bar`: auto draws the bar only on a terminal; its `\\r` redraws would run a log file's
    step lines (nohup, SLURM's .out) into one endless line. true or false decide regardless."""
    choice = str(setting).strip().lower()
    return choice == "true" or (choice == "auto" and stream.isatty())


def run_dir_line(run_dir: Path) -> str:
    """The first thing a run says: where its files go, and how to look at it from another terminal."""
    where = run_dir.resolve()
    return f"run dir: {where} (run.log, metrics.jsonl, status.json; progress: retrain status {shlex.quote(str(where))})"


def done_line(status: dict[str, Any], run_dir: Path) -> str:
    """The last thing a finished run says: where it is, its held-out result, and where the adapter is."""
    files = RunDir(run_dir.resolve())
    results = status.get("eval") or {}
    if "eval/after_greedy_accuracy" in results:
        result = "held-out accuracy " + ", ".join(
            f"{kind} {_percent(results.get(f'eval/before_{kind}_accuracy'))} -> "
            f"{_percent(results[f'eval/after_{kind}_accuracy'])}"
            for kind in ("greedy", "sampled")
        )
    else:
        result = "no held-out result (eval.num_examples=0)"
    steps = status.get("step", -1) + 1
    return f"done: {steps} step{'' if steps == 1 else 's'} in {files.path}; {result}; adapter: {files.final_dir}"


def _percent(value: float | None) -> str:
    return "?" if value is None else f"{100 * value:.1f}%"


def resume_command(run_dir: Path) -> str:
    """The command line that continues the run in `run_dir` exactly where its last checkpoint left it.

    Outside a Hydra job (retrain used as a library) the run's overrides are not known: `...` stands for them.
    """
    program = "retrain" if Path(sys.argv[0]).name == "retrain" else "python -m retrain"
    into = f"hydra.run.dir={shlex.quote(str(run_dir.resolve()))}"
    if not HydraConfig.initialized():
        return f"{program} ... {into}"
    hydra = HydraConfig.get()
    words = [program]
    for source in hydra.runtime.config_sources:
        if source.provider == "command-line":
            words += ["--config-dir", shlex.quote(str(source.path).removeprefix("file://"))]
    if hydra.job.config_name and hydra.job.config_name != "config":
        words += ["--config-name", shlex.quote(str(hydra.job.config_name))]
    words += [shlex.quote(masked_override(str(override))) for override in hydra.overrides.task]
    return " ".join([*words, into])
