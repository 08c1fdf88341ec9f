"""retrain against TRL's GRPOTrainer: step time on the same work, side by side (a script, not a test).

    pip install -e ".[bench]"     # trl 1.16; install your torch first, as the README says
    python benchmarks/vs_trl.py [--rounds 5] [--workloads quickstart small64 small64_gsm8k]
                                [--steps N --warmup K] [--threads N] [--vllm] [--trl-defaults] [-- OVERRIDE ...]

    python benchmarks/vs_trl.py --workloads quickstart small64 -- backend.devices=gpu:0    # both on a GPU

Workloads:
  quickstart  `python -m retrain experiment=quickstart`: the bundled tiny Qwen3, generated 2-digit
              additions, exact-match reward, B=8, G=8, 8 new tokens, T=1, top_p=1, lr 1e-3.
  small64     a random-init ~25M-parameter Qwen3 (hidden 512, 8 layers, 8 heads, 4 KV heads, the tiny
              byte tokenizer; benchmarks/_small64.py writes it once per run, seed 0) on the same prompts,
              B=4, G=8, 64 new tokens, lr 1e-5, and a reward that varies on a random model (vowel share).
  small64_gsm8k
              small64 on real questions: 256 of GSM8K's, shipped in benchmarks/data/gsm8k, 322 tokens
              each on average once chat-templated, against quickstart's 31. The share of a step's tokens that are
              prompt decides what retrain's prompt sharing saves: small64 shows a short-prompt case, this a
              long-prompt one (byte tokens make prompts ~4x longer than a BPE tokenizer would).

Each round runs retrain, then TRL, each in its own process (A B A B ...). retrain runs through its
real CLI with `algorithm=grpo_none`, and its step times are read from metrics.jsonl (`step_time_s`);
TRL runs in benchmarks/_trl_worker.py, where a TrainerCallback times each optimizer step. Each process
skips its first --warmup steps and reports the mean of the rest; a round's ratio is retrain's mean
over TRL's, and each workload ends with `retrain/TRL <workload> median <r> min <a> max <b>` over the rounds.
Round n runs both sides with training.seed=n-1 (round 1 is the demo's seed 0), so no single random
stream decides the result. Both run with torch's default threads unless --threads sets OMP_NUM_THREADS.

The same work per step: the TRL worker builds everything from retrain's composed config, so both
load the same model in the same dtype with the same LoRA adapter (rank, alpha, targets), serve the
same prompts in the same order (chat template, B prompts x G completions), sample with the same
max_tokens, temperature and top_p, score with the same reward function, and take one AdamW step
(same lr, betas, eps, weight decay, grad-norm clip) on one forward/backward of all rows, without
activation checkpointing. The loss matches: TRL with loss_type="dapo", beta=0 (no reference model),
scale_rewards="none", num_iterations=1; retrain's GRPO advantage r - mean(r) on fresh samples (the
ratio is 1, so neither side clips). Each round prints both sides' mean completion length and the
share of rows each trained on, so a difference in work shows.

What differs unavoidably:
- retrain leaves zero-advantage rows (groups whose rewards are all equal) out of the forward/backward
  and out of the token-mean's denominator; TRL forwards them and counts their tokens. The gradient's
  direction is the same, its scale differs. On quickstart such groups are common (retrain reports the
  share it trained on); on small64 the reward differs for every completion, so both train on all rows.
- Rewards: TRL calls the function in-process; retrain does so for the built-in exact match (quickstart)
  and scores plugins (small64's vowel share) in worker processes (timeout and crash isolation).
  Completions are sampled from different random streams, so lengths match only on average.
- Each side's own sampler: retrain's in-process engine (prompt prefix shared by a group) against
  transformers' generate on the repeated prompts, as TRL does without vLLM. Both left-pad prompts to the
  batch's longest, TRL in every row, retrain once per group.

--vllm samples with vLLM on both sides, in bf16 (what TRL's vLLM serves a float32 model in), from merged weights:
retrain with `inference=vllm inference.dtype=bf16 inference.merge_lora=true` (in-process vllm.LLM, the merged
weights reloaded into it at every sync; `-- inference.merge_lora=false` serves LoRA adapters instead), TRL with its
colocated mode (use_vllm=True, vllm_mode="colocate": vllm.LLM in the trainer's process, the merged weights
loaded into it before each generation; on vLLM's CPU build through vLLM's reload_weights, as TRL's own push
fails there: benchmarks/_trl_worker.py says why). Each round then also prints the largest per-step mean
|trainer - sampler| log-prob on each side: small when each sampler serves the weights just trained.

--trl-defaults runs TRL as it ships instead: bf16 mixed precision (autocast over the float32 weights) and
activation checkpointing stay on. That is not the same work (bf16 matmuls, one more forward per step), but it
is what a TRL user runs; on a CPU with bf16 instructions (AVX512-BF16, AMX) the autocast makes TRL faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
# The loss TRL's dapo/beta 0/unscaled setting matches; no checkpoints or evaluation inside the timed run.
COMMON = ["algorithm=grpo_none", "training.save_every=0", "eval.num_examples=0"]
RETRAIN_CLI = ["logging.progress_bar=false", "logging.console_groups=0"]
MODEL_SLOT = "{small64_model}"
# --vllm: TRL's colocated vLLM takes vLLM's dtype "auto", which serves a float32 checkpoint in bfloat16 (TRL has no
# key to change it), and loads the merged weights before each generation; retrain's vLLM then serves in bf16 too,
# merged, so both sample the same way.
VLLM = ["inference=vllm", "inference.dtype=bf16", "inference.merge_lora=true"]


@dataclass(frozen=True)
class Workload:
    overrides: list[str]  # retrain overrides; MODEL_SLOT is replaced by the small64 model's directory
    steps: int
    warmup: int


# lr 1e-5 keeps the random policy where it starts: at quickstart's 1e-3 it drifts within a few steps, and each
# side's completion lengths (the work of a step) go wherever its own samples push them.
SMALL64 = [
    "experiment=quickstart",
    f"model.name_or_path={MODEL_SLOT}",
    "training.batch_size=4",
    "training.max_tokens=64",
    "training.lr=1e-5",
    "reward._target_=_small64.vowel_share",
]
GSM8K_QUESTIONS = BENCHMARKS / "data" / "gsm8k"  # 256 questions of GSM8K's train split, shipped: see its README

WORKLOADS = {
    "quickstart": Workload(["experiment=quickstart"], steps=40, warmup=5),
    "small64": Workload(SMALL64, steps=12, warmup=3),
    # The same on real questions, ~10x longer than quickstart's: prompts take most of the step's tokens, and retrain
    # processes each once per group where TRL does once per row.
    "small64_gsm8k": Workload(
        [*SMALL64, "data=gsm8k", f"data.path={GSM8K_QUESTIONS}", "data.held_out_split=''"], steps=12, warmup=3
    ),
}


@dataclass(frozen=True)
class Measured:
    """One process's steps: wall time, mean completion tokens, share of the B*G rows trained on, and the mean
    |trainer - sampler| log-prob of the trained tokens (steps that trained; TRL reports it with vLLM only)."""

    step_time_s: list[float]
    completion_tokens: list[float]
    rows_trained: list[float]
    sampler_gap: list[float] = field(default_factory=list)


def retrain_measured(metrics_file: Path) -> Measured:
    records = sorted(
        (json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()),
        key=lambda record: record["step"],
    )
    return Measured(
        step_time_s=[r["step_time_s"] for r in records],
        completion_tokens=[r["mean_completion_tokens"] for r in records],
        rows_trained=[r["num_datums"] / (r["batch_size"] * r["group_size"]) for r in records],
        sampler_gap=[r["engine/logprob_abs_diff"] for r in records if "engine/logprob_abs_diff" in r],
    )


def trl_measured(out_file: Path) -> Measured:
    """The worker's JSON; TRL forwards and backpropagates every row."""
    data = json.loads(out_file.read_text())
    return Measured(
        step_time_s=data["step_time_s"],
        completion_tokens=data["completion_tokens"],
        rows_trained=[1.0] * len(data["step_time_s"]),
        sampler_gap=data.get("sampler_gap", []),
    )


def steady(values: list[float], warmup: int) -> float:
    """Mean of the values after the first `warmup` (the steady state)."""
    if len(values) <= warmup:
        raise ValueError(f"{len(values)} steps measured, but {warmup} are warm-up: raise --steps")
    return statistics.fmean(values[warmup:])


def summary_line(workload: str, ratios: list[float]) -> str:
    """`retrain/TRL <workload> median <r> min <a> max <b>` over the rounds' step-time ratios."""
    return f"retrain/TRL {workload} median {statistics.median(ratios):.2f} min {min(ratios):.2f} max {max(ratios):.2f}"


def round_line(workload: str, number: int, retrain: Measured, trl: Measured, warmup: int) -> str:
    ours, theirs = steady(retrain.step_time_s, warmup), steady(trl.step_time_s, warmup)
    line = (
        f"{workload} round {number}: retrain {ours:.3f} s/step, TRL {theirs:.3f} s/step, ratio {ours / theirs:.2f}"
        f" | tokens/completion {steady(retrain.completion_tokens, warmup):.1f} vs "
        f"{steady(trl.completion_tokens, warmup):.1f} | rows trained {steady(retrain.rows_trained, warmup):.0%} "
        f"vs {steady(trl.rows_trained, warmup):.0%}"
    )
    if retrain.sampler_gap and trl.sampler_gap:  # both sample with vLLM: each side's sampler serves fresh weights
        line += f" | sampler-trainer |dlogp| max {max(retrain.sampler_gap):.1e} vs {max(trl.sampler_gap):.1e}"
    return line


def run_logged(command: list[str], log_file: Path, env: dict[str, str], cwd: Path) -> None:
    with log_file.open("w") as log:
        finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, check=False)
    if finished.returncode != 0:
        tail = "\n".join(log_file.read_text().splitlines()[-30:])
        raise SystemExit(f"failed ({finished.returncode}): {' '.join(command)}\n{tail}")


def run_retrain(overrides: list[str], run_dir: Path, env: dict[str, str]) -> Measured:
    command = [sys.executable, "-m", "retrain", *overrides, *RETRAIN_CLI, f"hydra.run.dir={run_dir}"]
    run_logged(command, run_dir.with_suffix(".log"), env, run_dir.parent)
    return retrain_measured(run_dir / "metrics.jsonl")


def run_trl(overrides: list[str], out_file: Path, env: dict[str, str], options: list[str]) -> Measured:
    """The TRL worker with its `options` (--vllm, --trl-defaults) on retrain's overrides."""
    command = [sys.executable, str(BENCHMARKS / "_trl_worker.py"), *options, "--out", str(out_file), *overrides]
    run_logged(command, out_file.with_suffix(".log"), env, out_file.parent)
    return trl_measured(out_file)


def benchmark_env(threads: int | None) -> dict[str, str]:
    """The environment of every side: the small64 reward importable by name, no Hub look-ups, equal threads."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCHMARKS), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def workload_overrides(workload: Workload, extra: list[str], work: Path) -> list[str]:
    """The workload's overrides plus `extra`, with the small64 model written under `work` where one is named."""
    overrides = [*workload.overrides, *extra]
    if any(MODEL_SLOT in override for override in overrides):
        from _small64 import write_model  # benchmarks/ is sys.path[0] when run as a script

        model_dir = write_model(work / "small64_model")
        overrides = [override.replace(MODEL_SLOT, str(model_dir)) for override in overrides]
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="retrain/TRL pairs per workload")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--steps", type=int, help="steps per process (default: the workload's)")
    parser.add_argument("--warmup", type=int, help="first steps of each process left out (default: the workload's)")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both sides (default: torch's, one per core)")
    parser.add_argument("--vllm", action="store_true", help="both sides sample with vLLM (TRL: colocated mode)")
    parser.add_argument(
        "--trl-defaults",
        action="store_true",
        help="TRL as shipped: its bf16 autocast and activation checkpointing stay on (not the same work)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="more retrain overrides for both sides, e.g. backend.devices=gpu:0"
    )
    args = parser.parse_args()
    env = benchmark_env(args.threads)
    trl_options = [option for option, on in [("--vllm", args.vllm), ("--trl-defaults", args.trl_defaults)] if on]
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work = Path(tmp)
        for name in args.workloads:
            workload = WORKLOADS[name]
            steps, warmup = args.steps or workload.steps, workload.warmup if args.warmup is None else args.warmup
            engine = VLLM if args.vllm else []
            overrides = workload_overrides(
                workload, [*COMMON, *engine, *args.overrides, f"training.max_steps={steps}"], work
            )
            print(
                f"{name}: {steps} steps per process, {warmup} warm-up, training.seed = round - 1; overrides: "
                f"{' '.join(overrides)}{'; TRL with its bf16 autocast and checkpointing' if args.trl_defaults else ''}",
                flush=True,
            )
            ratios = []
            for number in range(1, args.rounds + 1):
                seeded = [*overrides, f"training.seed={number - 1}"]
                retrain = run_retrain(seeded, work / f"{name}_{number}_retrain", env)
                trl = run_trl(seeded, work / f"{name}_{number}_trl.json", env, trl_options)
                ratios.append(steady(retrain.step_time_s, warmup) / steady(trl.step_time_s, warmup))
                load = os.getloadavg()[0]  # the machine's other work: the ratio is only as good as its quiet
                print(f"{round_line(name, number, retrain, trl, warmup)} | load {load:.1f}", flush=True)
            print(summary_line(name, ratios), flush=True)


if __name__ == "__main__":
    main()
