"""What each loss recipe costs per step against the default objective, measured side by side (a script).

    python benchmarks/recipes.py [--steps 30] [--rounds 3] [--conditions token_mean,grpo,...]

Runs the quickstart (eval off) once per condition per round, alternating the conditions within a round,
each in its own `python -m retrain` process, and prints per condition the median over rounds of
(its median steady step time) / (token_mean's, same round), for the whole step and for its training
phase alone, with the range over rounds. token_mean is `algorithm=grpo_std_none` with the default loss
(PPO ratio, global token mean, no KL); each recipe picks its paper's advantage and loss (docs/recipes.md),
and the `upb*`/`mini*` conditions add several updates or optimizer steps per batch to token_mean. DAPO's
dynamic sampling draws extra groups (it prints the mean draws per step). docs/benchmarks.md reports what
it measured.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from retrain.housekeeping.rundir import RunDir

WARMUP = 5
COMMON = [
    "experiment=quickstart",
    "eval.num_examples=0",
    "training.save_every=0",
    "logging.progress_bar=false",
    "logging.console_groups=0",
]
BASELINE = "token_mean"
CONDITIONS = {
    BASELINE: ["algorithm=grpo_std_none"],
    "grpo": ["recipe=grpo"],
    "dr_grpo": ["recipe=dr_grpo"],
    "gspo": ["recipe=gspo"],
    "cispo": ["recipe=cispo"],
    "dapo": ["recipe=dapo"],
    "upb2": ["algorithm=grpo_std_none", "training.updates_per_batch=2", "training.clip_eps=0.2"],
    "upb4": ["algorithm=grpo_std_none", "training.updates_per_batch=4", "training.clip_eps=0.2"],
    "mini2": ["algorithm=grpo_std_none", "training.mini_batches=2", "training.clip_eps=0.2"],
}


def measure(overrides: list[str], steps: int, run_dir: Path) -> dict[str, float]:
    """One process: median steady step and training-phase times, and the mean DAPO draws per step."""
    command = [sys.executable, "-m", "retrain", *COMMON, f"training.max_steps={steps}", *overrides]
    command.append(f"hydra.run.dir={run_dir}")
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n" + "\n".join(log.read_text().splitlines()[-20:]))
    records = sorted(RunDir(run_dir).metrics_records(), key=lambda r: r["step"])[WARMUP:]
    return {
        "step": statistics.median(r["step_time_s"] for r in records),
        "train": statistics.median(r["train_time_s"] for r in records),
        "draws": statistics.mean(r.get("dapo/draws", 1) for r in records),
    }


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated; token_mean is added")
    args = parser.parse_args()
    names = [BASELINE] + [n for n in args.conditions.split(",") if n != BASELINE]
    unknown = sorted(set(names) - set(CONDITIONS))
    if unknown:
        raise SystemExit(f"unknown conditions {unknown}; known: {', '.join(CONDITIONS)}")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for number in range(args.rounds):
            for name in names:
                measured = measure(CONDITIONS[name], args.steps, Path(tmp) / f"{name}_{number}")
                rows[name].append(measured)
                print(f"round {number + 1} {name:<11} step {1000 * measured['step']:7.1f} ms  "
                      f"train {1000 * measured['train']:7.1f} ms  draws {measured['draws']:.2f}", flush=True)  # fmt: skip
    base = rows[BASELINE]
    print(f"\n{'condition':<11}{'step ms':>9}{'step / token_mean':>22}{'train / token_mean':>22}{'draws':>7}")
    for name in names:
        step = [m["step"] / b["step"] for m, b in zip(rows[name], base)]
        train = [m["train"] / b["train"] for m, b in zip(rows[name], base)]
        median_ms = 1000 * statistics.median(m["step"] for m in rows[name])
        draws = statistics.mean(m["draws"] for m in rows[name])
        print(f"{name:<11}{median_ms:>9.1f}{spread(step):>22}{spread(train):>22}{draws:>7.2f}")


if __name__ == "__main__":
    main()
