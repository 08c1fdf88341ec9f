"""What `training.deterministic=true` costs and buys: step time and bit-exactness, side by side (a script).

    python benchmarks/deterministic_cost.py [--rounds 3] [--workloads quickstart small64] [--steps N] [-- OVERRIDE ...]
    python benchmarks/deterministic_cost.py -- backend.devices=gpu:0      # where it matters: on a GPU

Each round runs the workload (benchmarks/vs_trl.py's, with the experiment's own algorithm) four times with
one seed, alternating default and deterministic kernels (D T D T), and prints the deterministic/default
step-time ratio and, for each mode, whether its two runs gave identical metrics (every field but wall
times) or the first step at which they differ. Ends with `deterministic/default <workload> median <r>
min <a> max <b>`. docs/reproducibility.md reports what it measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from vs_trl import WORKLOADS, benchmark_env, run_logged, steady, workload_overrides

from retrain.housekeeping.rundir import RunDir

COMMON = ["training.save_every=0", "eval.num_examples=0", "logging.progress_bar=false", "logging.console_groups=0"]
DETERMINISTIC = "training.deterministic=true"


class Run(NamedTuple):
    step_time_s: list[float]
    metrics: list[dict]  # every field but the wall-clock times (keys ending in _s)


def run(overrides: list[str], run_dir: Path, env: dict[str, str]) -> Run:
    """One `python -m retrain` process."""
    run_logged(
        [sys.executable, "-m", "retrain", *overrides, f"hydra.run.dir={run_dir}"],
        run_dir.with_suffix(".log"),
        env,
        run_dir.parent,
    )
    records = sorted(RunDir(run_dir).metrics_records(), key=lambda record: record["step"])
    return Run(
        [r["step_time_s"] for r in records], [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]
    )


def mean_step_time(twins: tuple[Run, Run], warmup: int) -> float:
    return statistics.fmean(steady(twin.step_time_s, warmup) for twin in twins)


def agreement(first: Run, second: Run) -> str:
    """'identical', or the first step whose metrics differ."""
    for a, b in zip(first.metrics, second.metrics):
        if a != b:
            return f"differ from step {a['step']}"
    return "identical" if len(first.metrics) == len(second.metrics) else "differ in length"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--steps", type=int, help="steps per process (default: the workload's)")
    parser.add_argument("overrides", nargs="*", help="more retrain overrides, e.g. backend.devices=gpu:0")
    args = parser.parse_args()
    env = benchmark_env(None)
    with tempfile.TemporaryDirectory(prefix="deterministic_") as tmp:
        work = Path(tmp)
        for name in args.workloads:
            workload = WORKLOADS[name]
            steps = args.steps or workload.steps
            overrides = workload_overrides(workload, [*COMMON, *args.overrides, f"training.max_steps={steps}"], work)
            print(
                f"{name}: {steps} steps per process, {workload.warmup} warm-up; overrides: {' '.join(overrides)}",
                flush=True,
            )
            ratios = []
            for number in range(1, args.rounds + 1):
                seeded = [*overrides, f"training.seed={number - 1}"]
                runs = {
                    (mode, twin): run([*seeded, *flags], work / f"{name}_{number}_{mode}_{twin}", env)
                    for twin in (1, 2)
                    for mode, flags in (("default", []), ("deterministic", [DETERMINISTIC]))
                }
                default, exact = ((runs[mode, 1], runs[mode, 2]) for mode in ("default", "deterministic"))
                fast_time, exact_time = mean_step_time(default, workload.warmup), mean_step_time(exact, workload.warmup)
                ratios.append(exact_time / fast_time)
                print(
                    f"{name} round {number}: default {fast_time:.3f} s/step, deterministic {exact_time:.3f} s/step, "
                    f"ratio {exact_time / fast_time:.2f} | default twins {agreement(*default)} | deterministic twins "
                    f"{agreement(*exact)}",
                    flush=True,
                )
            print(
                f"deterministic/default {name} median {statistics.median(ratios):.2f} min {min(ratios):.2f} "
                f"max {max(ratios):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
