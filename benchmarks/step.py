"""Where a training step's time goes on the quickstart workload (a script, not a test).

    python benchmarks/step.py [--steps 40] [override ...]

Runs the real trainer in-process (tiny model, arithmetic task, CPU unless overridden), skips the
first steps as warm-up, and prints the mean step time split into sampling / reward / advantages /
training / overlap wait / sync / everything else, plus the share of the step that is not model compute
(reward + advantages + everything else) and, apart, that of the sync.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

from retrain.config import compose
from retrain.run import run

PHASES = [
    ("sampling", "sample_time_s"),
    ("reward", "reward_time_s"),
    ("advantages", "advantage_time_s"),
    ("training", "train_time_s"),
    ("overlap wait", "overlap_wait_s"),  # split mode only: the next step's sampling still running
    ("sync", "sync_time_s"),  # weight sync to the engine and the freshness proof (model forwards of a probe)
    ("other", "other_time_s"),
]
MODEL_COMPUTE = {"sample_time_s", "train_time_s", "overlap_wait_s", "sync_time_s"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. algorithm=grpo_none")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    overrides = [
        "experiment=quickstart",
        "eval.num_examples=0",
        "logging.progress_bar=false",
        "logging.console_groups=0",
        f"training.max_steps={args.steps}",
        "training.save_every=0",
        *args.overrides,
    ]
    cfg = compose(overrides)
    with tempfile.TemporaryDirectory() as tmp:
        run(cfg, run_dir=Path(tmp))
        lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines][args.warmup :]
    step = statistics.mean(r["step_time_s"] for r in records)
    print(
        f"quickstart workload, {len(records)} measured steps ({args.warmup} warm-up skipped), "
        f"B={cfg.training.batch_size} G={cfg.training.group_size} max_tokens={cfg.training.max_tokens}, "
        f"algorithm={cfg.algorithm.name}"
    )
    print(f"{'phase':<12}{'mean ms':>10}{'share':>9}")
    for name, key in PHASES:
        mean = statistics.mean(r[key] for r in records)
        print(f"{name:<12}{1000 * mean:>10.2f}{mean / step:>9.1%}")
    print(f"{'step':<12}{1000 * step:>10.2f}{1.0:>9.1%}")
    overhead = sum(statistics.mean(r[key] for r in records) for _, key in PHASES if key not in MODEL_COMPUTE)
    print(f"not model compute (reward + advantages + other): {overhead / step:.1%} of the step")
    sync = statistics.mean(r["sync_time_s"] for r in records)
    print(f"sync (weight sync + freshness proof: probe forwards on both sides): {sync / step:.1%} of the step")


if __name__ == "__main__":
    main()
