"""Run dirs as the trainer writes them (run-dir contract), filled from small real simulations.

Each simulated run draws Bernoulli completions at a condition's success probability, so the tests can
recompute every statistic independently from the raw draws and compare with scipy.
"""

from __future__ import annotations

import json
import os
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from retrain.housekeeping.rundir import RunDir


@dataclass
class SimulatedRun:
    dir: Path
    condition: str
    seed: int
    draws: np.ndarray  # [steps, completions] bool: which completions were correct
    entropy_var: np.ndarray  # [steps]
    eval: dict[str, float]  # status.json's held-out accuracy before and after training ({}: none measured)
    eval_points: dict[int, dict[str, float]]  # metrics record's step -> its `eval/*` accuracies


def simulate_run(
    sweep_dir: Path,
    condition: str,
    seed: int,
    p_correct: float,
    steps: int = 12,
    batch_size: int = 4,
    group_size: int = 4,
    state: str = "done",
    entropy_scale: float = 1.0,
    num: int | None = None,
    pid: int | None = None,
    error: str | None = None,
    name: str | None = None,
    held_out: tuple[float, float] | None = None,
    eval_every: int = 0,
    eval_problems: int = 20,
) -> SimulatedRun:
    """Write `<sweep>/<name>` (default `<condition>_s<seed>`) with metrics.jsonl, status.json, job.json and .hydra/.

    `held_out`: the held-out success probability (before, after) training: accuracies drawn over `eval_problems`
    problems, greedy and sampled, into status.json's eval and, every `eval_every` steps (0: never), into the
    metrics record of the step the trainer measures after, at a probability between the two."""
    rng = np.random.default_rng([seed, zlib.crc32((name or condition).encode())])
    eval_rng = np.random.default_rng([seed, zlib.crc32((name or condition).encode()), 1])

    def accuracies(p: float) -> dict[str, float]:
        return {kind: float(eval_rng.binomial(eval_problems, p) / eval_problems) for kind in ("greedy", "sampled")}

    held = {} if held_out is None else {"before": accuracies(held_out[0]), "after": accuracies(held_out[1])}
    eval_results = {
        f"eval/{when}_{kind}_accuracy": value for when, found in held.items() for kind, value in found.items()
    }
    eval_points: dict[int, dict[str, float]] = {}
    completions = batch_size * group_size
    draws = rng.random((steps, completions)) < p_correct
    entropy = rng.gamma(4.0, entropy_scale / 4.0, size=steps)
    run_dir = RunDir(sweep_dir / (name or f"{condition}_s{seed}"))
    run_dir.hydra_dir.mkdir(parents=True, exist_ok=True)
    total_correct = 0
    with open(run_dir.metrics, "w") as handle:
        for step in range(steps):
            total_correct += int(draws[step].sum())
            record: dict[str, float] = {}
            if held_out is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
                share = (step + 1) / steps
                eval_points[step] = accuracies(held_out[0] + share * (held_out[1] - held_out[0]))
                record = {f"eval/{kind}_accuracy": value for kind, value in eval_points[step].items()}
            handle.write(
                json.dumps(
                    {
                        **record,
                        "step": step,
                        "condition": condition,
                        "seed": seed,
                        "loss": float(rng.normal()),
                        "mean_reward": float(draws[step].mean()),
                        "correct_rate": float(draws[step].mean()),
                        "running_correct_rate": total_correct / ((step + 1) * completions),
                        "batch_size": batch_size,
                        "group_size": group_size,
                        "exec_entropy_var": float(entropy[step]),
                        "step_time_s": 0.1,
                    }
                )
                + "\n"
            )
    status = {
        "state": state,
        "step": steps - 1,
        "max_steps": steps,
        "condition": condition,
        "seed": seed,
        "updated_at": time.time(),
        "pid": pid or os.getpid(),
        "hostname": socket.gethostname(),
        "error": error,
        "eval": eval_results,
    }
    run_dir.write_status(status)
    if num is not None:
        run_dir.job_file.write_text(
            json.dumps({"num": num, "pid": pid or os.getpid(), "hostname": socket.gethostname(), "slurm": {}})
        )
    run_dir.hydra_config.write_text(
        yaml.safe_dump({"algorithm": {"name": condition}, "training": {"seed": seed, "max_steps": steps}})
    )
    return SimulatedRun(run_dir.path, condition, seed, draws, entropy, eval_results, eval_points)


def dead_pid() -> int:
    """A pid that belonged to a process that has exited."""
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid
