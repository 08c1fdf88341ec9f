"""What sampling ahead does to learning: k = 0, 1, 2, 4, with and without correction, over seeds (a script).

    python benchmarks/async_learning.py [--workloads quickstart small64_gsm8k] [--seeds 3] [--ks 0 1 2 4]
        [--modes tis mask none] [--jobs 2]
    python benchmarks/async_learning.py --quick   # quickstart, 1 seed, 20 steps, 20 held-out questions, k = 0
                                                   # and 1: does it run at all

Every run is split mode on the CPU (`backend.devices=cpu,cpu`: the engine samples with its own copy of the
weights, which it swaps at each sync) with `training.max_staleness=k`; a batch of step s is sampled with the
weights of step s - k (the producer's schedule; an evaluation or checkpoint in between is a barrier), so a run's
batches do not depend on timing and a seed gives the same run whatever the machine's load. At k > 0 each seed runs
once per `training.mismatch_mode` in --modes: `tis` (truncated importance weights), `mask` (tokens whose weight
leaves the bounds dropped) and `none` (the plain PPO ratio against the sampler's log-probs); k = 0 runs once
(`none`: nothing to correct but rounding). The workloads are benchmarks/vs_trl.py's: quickstart (its full 150
steps, held-out greedy and sampled accuracy after training) and small64_gsm8k (--small64-steps steps of the
64-token model on GSM8K questions, rewarded by the share of vowels: it has no held-out split, so its score is the
mean reward of its last 10 steps). Printed per workload, k and mode: each score's mean over seeds and its range,
the mean `engine/policy_lag`, and the mismatch metrics' means over steps (`mismatch/kl`, `mismatch/ratio_min`,
`mismatch/ratio_max`, `mismatch/truncated_frac`; the trainer computes them only under a correction). --jobs runs
that many processes at once (one thread each). docs/benchmarks.md and docs/async.md report what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vs_trl import WORKLOADS, benchmark_env, run_logged, workload_overrides  # benchmarks/: sys.path[0]

from retrain.housekeeping.rundir import RunDir

COMMON = [
    "backend.devices='cpu,cpu'",
    "training.save_every=0",
    "logging.progress_bar=false",
    "logging.console_groups=0",
]
LAST_STEPS = 10  # small64_gsm8k's score: the mean reward of its last steps
MISMATCH = ("mismatch/kl", "mismatch/ratio_min", "mismatch/ratio_max", "mismatch/truncated_frac")
HELD_OUT = ("eval/after_greedy_accuracy", "eval/after_sampled_accuracy")
QUICK = {"workloads": ["quickstart"], "seeds": 1, "ks": [0, 1], "quickstart_steps": 20, "quickstart_eval": 20}


@dataclass(frozen=True)
class Condition:
    workload: str
    k: int
    mode: str

    @property
    def name(self) -> str:
        return f"{self.workload}_k{self.k}_{self.mode}"


def conditions(workloads: list[str], ks: list[int], modes: list[str]) -> list[Condition]:
    return [
        Condition(workload, k, mode) for workload in workloads for k in ks for mode in (["none"] if k == 0 else modes)
    ]


def scores(run_dir: Path, workload: str) -> dict[str, float]:
    """One finished run's score(s), mean policy lag and mean mismatch metrics."""
    records = sorted(RunDir(run_dir).metrics_records(), key=lambda r: r["step"])
    found: dict[str, float] = {}
    if workload == "quickstart":
        held_out = json.loads((run_dir / "status.json").read_text()).get("eval", {})
        found |= {key.removeprefix("eval/after_"): float(held_out[key]) for key in HELD_OUT if key in held_out}
    found[f"reward last {LAST_STEPS}"] = statistics.fmean(r["mean_reward"] for r in records[-LAST_STEPS:])
    found["policy_lag"] = statistics.fmean(r["engine/policy_lag"] for r in records)
    for key in MISMATCH:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if values:
            found[key.removeprefix("mismatch/")] = statistics.fmean(values)
    return found


def run(
    condition: Condition, seed: int, base: list[str], steps: int, held_out: int, work: Path, env: dict[str, str]
) -> dict[str, float]:
    """One `python -m retrain` process: the workload's overrides `base`, the condition's, the seed's; `held_out`
    questions evaluated before and after training (the quickstart's; small64_gsm8k has none)."""
    extra = [*COMMON, f"training.max_staleness={condition.k}", f"training.mismatch_mode={condition.mode}"]
    extra += [f"training.seed={seed}", f"training.max_steps={steps}"]
    extra.append(f"eval.num_examples={held_out if condition.workload == 'quickstart' else 0}")
    run_dir = work / f"{condition.name}_seed{seed}"
    command = [sys.executable, "-m", "retrain", *base, *extra, f"hydra.run.dir={run_dir}"]
    run_logged(command, run_dir.with_suffix(".log"), env, work)
    return scores(run_dir, condition.workload)


def report(condition: Condition, runs: list[dict[str, float]]) -> str:
    parts = []
    for key in runs[0]:
        values = [found[key] for found in runs if key in found]
        text = f"{key} {statistics.fmean(values):.3f}"
        if len(values) > 1 and key not in ("policy_lag",):
            text += f" ({min(values):.3f}-{max(values):.3f})"
        parts.append(text)
    return f"{condition.workload:<14} k={condition.k} {condition.mode:<5} " + " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=["quickstart", "small64_gsm8k"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2, 4])
    parser.add_argument("--quickstart-steps", type=int, default=150, help="the quickstart's own 150 by default")
    parser.add_argument("--quickstart-eval", type=int, default=200, help="held-out questions, the quickstart's 200")
    parser.add_argument("--small64-steps", type=int, default=12, help="benchmarks/vs_trl.py's length")
    parser.add_argument("--modes", nargs="+", choices=["tis", "mask", "none"], default=["tis", "mask", "none"])
    parser.add_argument("--jobs", type=int, default=2, help="processes at once, one thread each")
    parser.add_argument("--quick", action="store_true", help="quickstart, 1 seed, 20 steps, 20 held out, k = 0, 1")
    args = parser.parse_args()
    if args.quick:
        args.workloads, args.seeds, args.ks = QUICK["workloads"], QUICK["seeds"], QUICK["ks"]
        args.quickstart_steps, args.quickstart_eval = QUICK["quickstart_steps"], QUICK["quickstart_eval"]
    workloads = args.workloads or ["quickstart", "small64_gsm8k"]
    steps = {"quickstart": args.quickstart_steps, "small64_gsm8k": args.small64_steps}
    env = benchmark_env(1)
    todo = conditions(workloads, args.ks, args.modes)
    print(f"{len(todo)} conditions x {args.seeds} seeds, {args.jobs} at once; steps {steps}", flush=True)
    with tempfile.TemporaryDirectory(prefix="async_learning_") as tmp, ThreadPoolExecutor(args.jobs) as pool:
        work = Path(tmp)
        base = {workload: workload_overrides(WORKLOADS[workload], [], work) for workload in workloads}
        futures = {
            (condition, seed): pool.submit(
                run,
                condition,
                seed,
                base[condition.workload],
                steps[condition.workload],
                args.quickstart_eval,
                work,
                env,
            )
            for condition in todo
            for seed in range(args.seeds)
        }
        for condition in todo:
            print(report(condition, [futures[condition, seed].result() for seed in range(args.seeds)]), flush=True)


if __name__ == "__main__":
    main()
