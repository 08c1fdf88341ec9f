"""The demo's step time by thread policy, on a quiet machine and with a CPU hog pinned to one core (a script).

    python benchmarks/threads.py [--steps 20] [--rounds 1] [--cpus 0,1] [--hog-core 0]

Runs the quickstart (eval off) in processes confined to `--cpus` (`taskset`), three ways each round:
  before      torch's default: one thread per CPU, idle OpenMP threads spin ~3 ms before they sleep
              (libgomp's default spin count, 300000, set as GOMP_SPINCOUNT) — what retrain did before
  after       retrain's own choice: the usable CPUs, OMP_WAIT_POLICY=PASSIVE (retrain/housekeeping/threads.py)
  one-thread  OMP_NUM_THREADS=1
first with nothing else running on those CPUs (quiet), then with a busy loop pinned to `--hog-core`
(hog). Prints each run's median step time (the first 2 steps left out) and, per round, the after/before
ratio for each condition. docs/benchmarks.md reports what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrain.housekeeping.rundir import RunDir

WARMUP = 2
COMMON = [
    "experiment=quickstart",
    "eval.num_examples=0",
    "training.save_every=0",
    "logging.progress_bar=false",
]
LIBGOMP_DEFAULT_SPINCOUNT = "300000"  # libgomp (env.c): the spin count when OMP_WAIT_POLICY is not set


def policies(cpus: int) -> dict[str, tuple[dict[str, str], list[str]]]:
    """name -> (environment, overrides)."""
    return {
        "before": ({"GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPINCOUNT}, [f"training.threads={cpus}"]),
        "after": ({}, []),
        "one-thread": ({"OMP_NUM_THREADS": "1"}, []),
    }


def median_step_s(cpus: str, env: dict[str, str], overrides: list[str], steps: int, run_dir: Path) -> float:
    """One `python -m retrain` process confined to `cpus`; its median steady step time."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    command = ["taskset", "-c", cpus, sys.executable, "-m", "retrain", *COMMON, f"training.max_steps={steps}"]
    command += [*overrides, f"hydra.run.dir={run_dir}"]
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        done = subprocess.run(command, env={**base, **env}, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n" + "\n".join(log.read_text().splitlines()[-20:]))
    times = [r["step_time_s"] for r in sorted(RunDir(run_dir).metrics_records(), key=lambda r: r["step"])]
    return statistics.median(times[WARMUP:])


@contextmanager
def hog(core: int | None) -> Iterator[None]:
    """A busy loop pinned to `core` for the duration (nothing when None)."""
    if core is None:
        yield
        return
    process = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        process.kill()
        process.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cpus", default="0,1", help="the CPUs the runs may use (taskset -c)")
    parser.add_argument("--hog-core", type=int, default=0, help="the CPU the busy loop is pinned to")
    args = parser.parse_args(argv)
    count = len(args.cpus.split(","))
    work = Path(tempfile.mkdtemp(prefix="retrain-threads-"))
    for number in range(1, args.rounds + 1):
        medians: dict[tuple[str, str], float] = {}
        for condition, core in (("quiet", None), ("hog", args.hog_core)):
            with hog(core):
                for name, (env, overrides) in policies(count).items():
                    run_dir = work / f"r{number}_{condition}_{name}"
                    medians[condition, name] = median_step_s(args.cpus, env, overrides, args.steps, run_dir)
                    print(f"round {number} {condition:<5} {name:<10} median step {medians[condition, name]:.3f} s")
        for condition in ("quiet", "hog"):
            before, after = medians[condition, "before"], medians[condition, "after"]
            print(f"round {number} {condition}: after/before {after / before:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
