"""The real workload's shape: Qwen3-4B (random weights), LoRA rank 32, B=8 × G=16, 2,048 and 10,240 new tokens
(a script, not a test).

    python benchmarks/real_scale.py [--tokens 2048 10240] [--budget-s 450] [--out real_scale.json]
        [--profile-tokens 128] [override ...]
    python benchmarks/real_scale.py --layers 2 --batch 1 --group 2 --tokens 4 8 --prompt-tokens 16   # CPU smoke

A model directory with Qwen3-4B-Instruct-2507's exact config (`--layers` cuts its depth) and a tokenizer of its
vocabulary size are written offline (benchmarks/_real_scale_model.py); retrain's own parts load it as any model:
ModelSpec + LocalBackend (bf16 on CUDA), `inference=pytorch` with `inference.kv_cache_gb`, the config's algorithm.
Each scenario is one real step: sample → reward (the vowel share of each completion: every group carries
signal) → advantages → train → sync (weight sync and the freshness proof). A random model rarely emits EOS, so
rows run to the token limit: the worst case. At 2,048 tokens all B × G rows sample; at longer limits only the
groups whose full-length KV cache fits `--kv-cache-gb` (with 10% slack) sample, so one wave of rows fills the budget.

Per phase: seconds and peak memory (CUDA: torch.cuda.max_memory_allocated, reset per phase; CPU: growth of the
resident set over the phase, sampled every 5 ms), CUDA's allocator retries (target 0), the memory plan's predicted peak (`planned_peak_gb`), decode
tokens/s against the memory-bandwidth bound and training tokens/s with MFU (benchmarks/_speed_bounds.py). A
scenario whose predicted time (scaled from the one before) would overrun `--budget-s` is skipped and says so.
Ends with a markdown table (for docs/benchmarks.md) and, with --out, the same numbers as JSON. `--profile-tokens N`
adds one more step at N tokens under torch.profiler (not in the table): its sampling's and training's ops by their
own time on the device, the kernels on a GPU, and that time's sum against the phase's wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from _real_scale_model import write_model  # benchmarks/ is sys.path[0] as a script
from _small64 import vowel_share
from _speed_bounds import (
    copy_bandwidth,
    decode_kv_reads,
    lora_training_flops,
    peak_bf16_flops,
)
from omegaconf import DictConfig, OmegaConf
from torch.profiler import ProfilerActivity, profile

from retrain.backend.settings import LossSettings, OptimSettings
from retrain.config import TrainingConfig, compose
from retrain.inference.sampler.kv_pool import KvShape
from retrain.model.device_memory import device_memories
from retrain.model.memory_plan import plan_for
from retrain.model.probe import Probe
from retrain.model.spec import ChatPrompts
from retrain.run import build_part, checked_memory_plan, plan_parts, planning_detection, with_resolved_checkpointing
from retrain.training.freshness import FreshnessProof
from retrain.types import SamplingParams, TrainBatch

GB = 1e9
KV_SLACK = 0.9  # share of the KV budget the full-length rows may fill (page rounding, the prefill's transients)
RSS_PERIOD_S = 0.005
PHASES = ("sample", "train", "sync")
PROFILE_ROWS = 25  # ops listed per profiled phase
PROMPT_WORDS = ("solve", "the", "sum", "of", "seven", "and", "nine", "then", "explain", "why")


def planned_peak_gb(cfg: DictConfig, groups: int, max_tokens: int, prompt_tokens: int) -> dict[str, float] | None:
    """The memory plan's (retrain/model/memory_plan.py) predicted peak of each phase, in GB, for `groups` prompts
    at `max_tokens` with prompts of `prompt_tokens`: on CUDA the resident parts plus the phase's (what
    max_memory_allocated measures), on the CPU the phase's own (what the resident set's growth measures).
    None when no plan applies."""
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    config["training"] = {**config["training"], "batch_size": groups, "max_tokens": max_tokens}
    memories, on_gpu = device_memories(str(cfg.backend.devices))
    plan = plan_for(config, memories, on_gpu, prompt_tokens=prompt_tokens)
    if plan is None:
        return None
    device = plan.devices[0]
    resident = device.phase_bytes("resident") if on_gpu else 0
    phase_bytes = {"sample": device.phase_bytes("sampling"), "train": device.phase_bytes("training"), "sync": 0}
    return {phase: (resident + value) / GB for phase, value in phase_bytes.items()}


@dataclass
class Phase:
    """Seconds and peak memory of a block: CUDA's allocator peak (reset at entry), or the CPU's RSS growth."""

    device: torch.device
    seconds: float = 0.0
    peak_gb: float = 0.0
    alloc_retries: int | None = None  # CUDA: the caching allocator's retries (a free-and-retry after an OOM)
    _started: float = 0.0
    _rss_start: int = 0
    _rss_peak: int = 0
    _watching: threading.Event = field(default_factory=threading.Event)
    _watcher: threading.Thread | None = None

    def __enter__(self) -> Phase:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.alloc_retries = -_alloc_retries(self.device)
        else:
            self._rss_start = self._rss_peak = resident_bytes()
            self._watching.set()
            self._watcher = threading.Thread(target=self._watch_rss, daemon=True)
            self._watcher.start()
        self._started = time.perf_counter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - self._started
        if self.device.type == "cuda":
            self.peak_gb = torch.cuda.max_memory_allocated(self.device) / GB
            self.alloc_retries = (self.alloc_retries or 0) + _alloc_retries(self.device)
        else:
            self._watching.clear()
            assert self._watcher is not None
            self._watcher.join()
            self._rss_peak = max(self._rss_peak, resident_bytes())
            self.peak_gb = (self._rss_peak - self._rss_start) / GB

    def _watch_rss(self) -> None:
        while self._watching.is_set():
            self._rss_peak = max(self._rss_peak, resident_bytes())
            time.sleep(RSS_PERIOD_S)


@contextmanager
def profiled(name: str, device: torch.device, tables: dict[str, str] | None) -> Iterator[None]:
    """torch.profiler around a phase where `tables` collects them: the ops by their own time on the device (on a
    GPU the kernels, those of replayed CUDA graphs included), and that time's sum against the phase's wall time:
    what a step spends its time on, for the next change to aim at."""
    if tables is None:
        yield
        return
    cuda = device.type == "cuda"
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as trace:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    wall_s = time.perf_counter() - started
    events = trace.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy_s = sum(getattr(event, key) for event in events) / 1e6
    tables[name] = f"{name}: the ops' {key} sums to {busy_s:.2f} s over the phase's {wall_s:.2f} s\n" + events.table(
        sort_by=key, row_limit=PROFILE_ROWS
    )


def _alloc_retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def resident_bytes() -> int:
    """This process's resident set (Linux /proc)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


@dataclass
class Parts:
    """retrain's parts as its composition root builds them, and what the measurements need of them."""

    cfg: DictConfig
    training: TrainingConfig
    backend: Any
    engine: Any
    algorithm: Any
    planning: Any
    prompts: ChatPrompts
    freshness: FreshnessProof
    device: torch.device
    bandwidth: float  # bytes/s of a large copy on `device`


def build_parts(cfg: DictConfig) -> Parts:
    """Model, backend, engine, algorithm and freshness proof from `cfg`, as retrain.run.build_trainer builds them."""
    training: TrainingConfig = OmegaConf.to_object(cfg.training)  # type: ignore[assignment]
    seed = max(training.seed, 0)
    algorithm = plan_parts(cfg).algorithm
    model = build_part(cfg, "model")
    tokenizer = model.load_tokenizer()
    backend = build_part(
        with_resolved_checkpointing(cfg, checked_memory_plan(cfg)),  # as the run resolves checkpointing=auto
        "backend",
        model=model,
        optim=OptimSettings.from_config(training),
        loss=LossSettings.from_config(training),
        seed=seed,
    )
    engine = build_part(cfg, "inference", tokenizer=tokenizer, resources=backend.engine_resources())
    freshness = FreshnessProof(Probe.from_tokenizer(tokenizer), backend)
    freshness.check(engine, 0)  # as the trainer does: the engine starts on the initial adapter
    return Parts(
        cfg=cfg,
        training=replace(training, seed=seed),
        backend=backend,
        engine=engine,
        algorithm=algorithm,
        planning=planning_detection(algorithm, tokenizer),
        prompts=ChatPrompts(tokenizer, model.name_or_path),
        freshness=freshness,
        device=backend.device,
        bandwidth=copy_bandwidth(backend.device),
    )


def prompt_text(index: int, length: int) -> str:
    """A distinct prompt of `length` characters (one token each with the byte-level tokenizer)."""
    words = [PROMPT_WORDS[(index + i) % len(PROMPT_WORDS)] for i in range(length)]
    return f"{index} {' '.join(words)}"[:length]


def groups_admitted(parts: Parts, prompt_tokens: int, max_tokens: int, kv_cache_gb: float, batch: int) -> int:
    """Groups whose rows fit the KV budget at full length (all of them when the budget is automatic, 0)."""
    if kv_cache_gb <= 0:
        return batch
    model = parts.backend.engine_resources().model
    row = KvShape.of(model.config, model.dtype).bytes_per_token * (prompt_tokens + max_tokens + 16)  # 16: chat template
    return max(1, min(batch, math.floor(KV_SLACK * kv_cache_gb * GB / (row * parts.training.group_size))))


def run_scenario(
    parts: Parts, step: int, max_tokens: int, groups: int, prompt_tokens: int, profiles: dict[str, str] | None = None
) -> dict[str, Any]:
    """One real step at `max_tokens` new tokens for `groups` prompts: each phase timed, with its bounds; sampling
    and training profiled into `profiles` where given."""
    training, group_size, device = parts.training, parts.training.group_size, parts.device
    sampling = replace(
        SamplingParams.from_config(training, return_entropies=parts.algorithm.needs_entropies), max_tokens=max_tokens
    )
    prompt_ids = parts.prompts([prompt_text(index, prompt_tokens) for index in range(groups)])
    model = parts.backend.engine_resources().model
    with Phase(device) as sample, profiled("sample", device, profiles):
        rollouts = parts.engine.generate(prompt_ids, group_size, sampling, step)
    forwards = int(rollouts.metrics["engine/forwards"])  # replayed CUDA graphs run no module hook: the engine counts

    step_metrics = parts.algorithm.begin_step(step)
    rewards = torch.tensor([vowel_share(text, "") for text in rollouts.texts]).view(groups, group_size)
    planning = None if parts.planning is None else parts.planning(rollouts.completion_ids, rollouts.trained_mask)
    advantage = parts.algorithm.compute(rewards, rollouts.logprobs, rollouts.trained_mask, rollouts.entropies, planning)
    row_mask = advantage.group_has_signal.repeat_interleave(group_size)
    batch = TrainBatch(rollouts=rollouts, advantages=advantage.token_advantages, row_mask=row_mask)
    with Phase(device) as train, profiled("train", device, profiles):
        result = parts.backend.train(batch)
    planned = planned_peak_gb(parts.cfg, groups, max_tokens, int(rollouts.prompt_mask.sum(dim=1).max()))
    with Phase(device) as sync:
        if result.update is not None:
            parts.engine.sync(result.update)
            parts.freshness.check(parts.engine, result.update.version)

    prompt_lengths = rollouts.prompt_mask.sum(dim=1).repeat_interleave(group_size)
    completion_lengths = rollouts.completion_mask.sum(dim=1)
    completion_tokens = int(completion_lengths.sum())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_read = KvShape.of(model.config, model.dtype).bytes_per_token * decode_kv_reads(
        prompt_lengths, completion_lengths
    )
    bound_s = (forwards * weight_bytes + kv_read) / parts.bandwidth
    trained = row_mask & (completion_lengths > 0)
    sequence_lengths = (prompt_lengths + completion_lengths)[trained]
    adapter = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and "lora_" in name)
    flops = lora_training_flops(model.config, adapter, sequence_lengths)
    peak = peak_bf16_flops(device)
    phases = {"sample": sample, "train": train, "sync": sync}
    return {
        "max_tokens": max_tokens,
        "rows": groups * group_size,
        "prompt_tokens": int(prompt_lengths.float().mean()),
        "completion_tokens": completion_tokens,
        "hit_max_tokens_rate": float(rollouts.hit_max_tokens.float().mean()),
        "forwards": forwards,
        "engine_metrics": dict(rollouts.metrics),  # engine/* once the KV budget lands
        "train_loss": result.loss,
        "trained_tokens": int(sequence_lengths.sum()),
        "algorithm_metrics": step_metrics,
        "phases": {
            name: {
                "seconds": phase.seconds,
                "peak_gb": phase.peak_gb,
                "planned_peak_gb": None if planned is None else planned[name],
                "alloc_retries": phase.alloc_retries,
            }
            for name, phase in phases.items()
        },
        "decode_tokens_per_s": completion_tokens / sample.seconds,
        "decode_bound_tokens_per_s": completion_tokens / bound_s,
        "decode_share_of_bound": bound_s / sample.seconds,
        "train_tokens_per_s": int(sequence_lengths.sum()) / train.seconds,
        "train_flops": flops,
        "mfu": None if peak is None else flops / train.seconds / peak,
    }


def predicted_seconds(previous: dict[str, Any], max_tokens: int, rows: int) -> float:
    """A scenario's time scaled from the one before: sampling by decode steps, training by rows × length,
    the sync as it was (an upper estimate when fewer rows sample)."""
    phases = previous["phases"]
    longer = max_tokens / previous["max_tokens"]
    train = phases["train"]["seconds"] * longer * rows / previous["rows"]
    return phases["sample"]["seconds"] * longer + train + phases["sync"]["seconds"]


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(scenarios: list[dict[str, Any]]) -> list[str]:
    """One row per scenario and phase: seconds, peak memory, the plan's peak, throughput against its bound."""
    lines = [
        "| new tokens | rows | phase | seconds | peak GB | plan peak GB | alloc retries | tokens/s | bound tokens/s "
        "| of bound | MFU |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scenario in scenarios:
        for name in PHASES:
            phase = scenario["phases"][name]
            rate = bound = share = mfu = None
            if name == "sample":
                rate, bound = scenario["decode_tokens_per_s"], scenario["decode_bound_tokens_per_s"]
                share = scenario["decode_share_of_bound"]
            elif name == "train":
                rate, mfu = scenario["train_tokens_per_s"], scenario["mfu"]
            lines.append(
                f"| {scenario['max_tokens']:,} | {scenario['rows']} | {name} | {phase['seconds']:.2f} "
                f"| {phase['peak_gb']:.2f} | {fmt(phase['planned_peak_gb'], '.2f')} "
                f"| {fmt(phase.get('alloc_retries'), 'd')} | {fmt(rate, ',.0f')} "
                f"| {fmt(bound, ',.0f')} | {fmt(share, '.1%')} | {fmt(mfu, '.1%')} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="decoder layers (default: Qwen3-4B's 36)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (B)")
    parser.add_argument("--group", type=int, default=16, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 10240], help="new tokens, one scenario each")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="characters (= tokens) of each prompt")
    parser.add_argument(
        "--kv-cache-gb", type=float, help="inference.kv_cache_gb (default: 48 on CUDA, 0 = automatic on CPU)"
    )
    parser.add_argument("--budget-s", type=float, default=450.0, help="skip a scenario predicted to end after this")
    parser.add_argument("--out", type=Path, help="write the measurements as JSON here")
    parser.add_argument(
        "--profile-tokens", type=int, default=0, help="then one more step at this many tokens, profiled (0: none)"
    )
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides, e.g. backend.gradient_checkpointing=true")
    args = parser.parse_args()
    started = time.perf_counter()
    logging.basicConfig(level=logging.WARNING)
    cuda = torch.cuda.is_available()
    kv_cache_gb = args.kv_cache_gb if args.kv_cache_gb is not None else (48.0 if cuda else 0.0)
    with tempfile.TemporaryDirectory(prefix="real_scale_") as tmp:
        config = write_model(Path(tmp), args.layers, "cuda" if cuda else "cpu")
        overrides = [
            f"model.name_or_path={tmp}",
            "model.lora_rank=32",
            f"backend.devices={'gpu:0' if cuda else 'cpu'}",
            "inference=pytorch",
            f"inference.kv_cache_gb={kv_cache_gb}",
            f"training.batch_size={args.batch}",
            f"training.group_size={args.group}",
            f"training.max_tokens={max(args.tokens)}",
        ]
        overrides += args.overrides
        cfg = compose(overrides)
        parts = build_parts(cfg)
        setup_s = time.perf_counter() - started
        print(
            f"Qwen3-4B shape, {config['num_hidden_layers']} layers, random weights, LoRA rank 32, "
            f"{str(parts.backend.engine_resources().model.dtype).removeprefix('torch.')} on {parts.device}; "
            f"copy bandwidth {parts.bandwidth / GB:,.0f} GB/s; setup {setup_s:.1f} s",
            flush=True,
        )
        scenarios: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for step, max_tokens in enumerate(args.tokens):
            groups = groups_admitted(parts, args.prompt_tokens, max_tokens, kv_cache_gb, args.batch)
            rows = groups * args.group
            elapsed = time.perf_counter() - started
            if scenarios:
                predicted = predicted_seconds(scenarios[-1], max_tokens, rows)
                if elapsed + predicted > args.budget_s:
                    print(
                        f"{max_tokens} tokens × {rows} rows skipped: ~{predicted:.0f} s predicted, "
                        f"{args.budget_s - elapsed:.0f} s of --budget-s left",
                        flush=True,
                    )
                    skipped.append({"max_tokens": max_tokens, "rows": rows, "predicted_s": predicted})
                    continue
            scenarios.append(run_scenario(parts, step, max_tokens, groups, args.prompt_tokens))
            at_limit = scenarios[-1]["hit_max_tokens_rate"]
            print(
                f"{max_tokens} tokens × {rows} rows done at {time.perf_counter() - started:.0f} s "
                f"({at_limit:.0%} of the rows ran to the limit)",
                flush=True,
            )
        profiles: dict[str, str] = {}
        if args.profile_tokens > 0:
            groups = groups_admitted(parts, args.prompt_tokens, args.profile_tokens, kv_cache_gb, args.batch)
            run_scenario(parts, len(args.tokens), args.profile_tokens, groups, args.prompt_tokens, profiles)
            print(f"\nprofiled: a step at {args.profile_tokens} tokens × {groups * args.group} rows (not in the table)")
            print("\n\n".join(profiles.values()))
    memory = "torch.cuda.max_memory_allocated per phase" if cuda else "RSS growth over the phase (CPU)"
    print(f"\npeak GB: {memory}; tokens/s: decode (sample), prompt + completion tokens trained (train)")
    print("\n".join(markdown_table(scenarios)))
    for scenario in scenarios:
        if scenario["engine_metrics"]:
            print(f"engine at {scenario['max_tokens']} tokens: {json.dumps(scenario['engine_metrics'])}")
    total_s = time.perf_counter() - started
    print(f"total {total_s:.0f} s (setup {setup_s:.0f} s)")
    if args.out is not None:
        report = {
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "layers": config["num_hidden_layers"],
            "batch": args.batch,
            "group": args.group,
            "kv_cache_gb": kv_cache_gb,
            "copy_bandwidth_gb_s": parts.bandwidth / GB,
            "peak_bf16_flops": peak_bf16_flops(parts.device),
            "peak_memory": memory,
            "setup_s": setup_s,
            "total_s": total_s,
            "scenarios": scenarios,
            "skipped": skipped,
            "profiles": profiles,
            "overrides": overrides[1:],
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
