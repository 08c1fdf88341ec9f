"""The demo's step time by thread policy, on a quiet machine and with a CPU hog pinned to one core (a script).

    python benchmarks/threads.py [--steps 20] [--rounds 1] [--cpus 0,1] [--hog-core 0]
                                 [--policies before,passive,after,one-thread] [--conditions quiet,hog]

Runs the quickstart (eval off) in processes confined to `--cpus` (`taskset`), four ways each round:
  before      torch's default: one thread per CPU, idle OpenMP threads spin ~3 ms before they sleep
              (libgomp's default spin count, 300000, set as GOMP_SPINCOUNT) — what retrain did first
  passive     one thread per CPU that sleeps at once (OMP_WAIT_POLICY=PASSIVE) — what retrain did next
  after       retrain's own choice: one thread per usable CPU, spinning unless they outnumber the CPUs
              idle at the start, then sleeping (retrain/housekeeping/threads.py); its log line is printed
  one-thread  OMP_NUM_THREADS=1
first with nothing else of the benchmark's running on those CPUs (quiet), then with a busy loop pinned
to `--hog-core` (hog). Prints each run's median step time (the first 2 steps left out) and, per round,
the after/before and after/one-thread ratios for each condition. docs/benchmarks.md reports what it
measured. With a hog, `before` takes ~30 s a step on 2 CPUs: `--policies` leaves it out.
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
        "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, [f"training.threads={cpus}"]),
        "after": ({}, []),
        "one-thread": ({"OMP_NUM_THREADS": "1"}, []),
    }


def median_step_s(cpus: str, env: dict[str, str], overrides: list[str], steps: int, run_dir: Path) -> tuple[float, str]:
    """One `python -m retrain` process confined to `cpus`: its median steady step time, its threads line."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    command = ["taskset", "-c", cpus, sys.executable, "-m", "retrain", *COMMON, f"training.max_steps={steps}"]
    command += [*overrides, f"hydra.run.dir={run_dir}"]
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        done = subprocess.run(command, env={**base, **env}, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(command)}\n" + "\n".join(log.read_text().splitlines()[-20:]))
    times = [r["step_time_s"] for r in sorted(RunDir(run_dir).metrics_records(), key=lambda r: r["step"])]
    threads = next(line for line in log.read_text().splitlines() if line.startswith("torch threads: "))
    return statistics.median(times[WARMUP:]), threads


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
    parser.add_argument("--policies", default="before,passive,after,one-thread")
    parser.add_argument("--conditions", default="quiet,hog")
    args = parser.parse_args(argv)
    count = len(args.cpus.split(","))
    chosen = {name: policy for name, policy in policies(count).items() if name in args.policies.split(",")}
    conditions = [(name, None if name == "quiet" else args.hog_core) for name in args.conditions.split(",")]
    work = Path(tempfile.mkdtemp(prefix="retrain-threads-"))
    for number in range(1, args.rounds + 1):
        medians: dict[tuple[str, str], float] = {}
        for condition, core in conditions:
            with hog(core):
                for name, (env, overrides) in chosen.items():
                    run_dir = work / f"r{number}_{condition}_{name}"
                    median, threads = median_step_s(args.cpus, env, overrides, args.steps, run_dir)
                    medians[condition, name] = median
                    print(f"round {number} {condition:<5} {name:<10} median step {median:.3f} s  [{threads}]")
                    print(f"  load average {os.getloadavg()[0]:.1f}", flush=True)
        for condition, _ in conditions:
            for other in ("before", "one-thread"):
                if (condition, "after") in medians and (condition, other) in medians:
                    ratio = medians[condition, "after"] / medians[condition, other]
                    print(f"round {number} {condition}: after/{other} {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
