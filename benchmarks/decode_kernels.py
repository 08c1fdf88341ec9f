"""A decode step's suspects at Qwen3-4B's shape, each timed alone beside its alternatives (a script, not a test).

    python benchmarks/decode_kernels.py [--rows 128] [--context 2048] [--block-tokens 16 64 128] [--out F]
    python benchmarks/decode_kernels.py --quick          # a CPU smoke: small shapes, the same code

On the H200 a warm decode step of 128 rows took 17.7 ms against a bound of 7.1 ms (docs/benchmarks.md, "Real
scale"). Its two suspects, measured here without the rest of the step:

- **attention over the KV pool** (`inference.paged_attention=flex`): compiled flex_attention through the rows'
  block tables (retrain/inference/sampler/paged_attention.py) at the pool's block size (16 tokens), there also with
  deeper software pipelines (flex_attention's `kernel_options`), and at larger block sizes, against sdpa over the same keys and values stored contiguously (the dense decode kernel's speed, which paging
  should approach). Each reads every row's live keys and values once: its rate is those bytes per second, against
  the copy bandwidth measured here. Each output is checked against sdpa's first. The block mask's construction
  (once per step, outside the layers) is timed apart.
- **the token choice** (retrain/inference/sampler/tokens.py) over [rows, vocabulary] fp32 logits with entropies:
  top-p 0.95 (the default: a sort of every row's vocabulary) against 1.0 (none).

Times are medians over `--repeats` timed runs of `--calls` back-to-back calls (CUDA events on a GPU), after a
warm-up that compiles. Per step multiplies attention by the layers (36).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _speed_bounds import copy_bandwidth

from retrain.inference.config import KV_BLOCK_TOKENS
from retrain.inference.sampler.paged_attention import paged_attention, paged_block_mask, pool_sequence, row_bucket
from retrain.inference.sampler.tokens import choose_tokens
from retrain.types import SamplingParams

GB = 1e9
PIPELINES = [{"num_stages": 2}, {"num_stages": 3, "num_warps": 4}]  # flex_attention kernel_options tried
QUICK = {"rows": 4, "context": 40, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 512, "block_tokens": [16, 32]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument(
        "--context", type=int, default=2048, help="tokens in every row's KV cache, the new one included"
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=36, help="attention calls per decode step")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[KV_BLOCK_TOKENS, 64, 128])
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; their median is reported")
    parser.add_argument("--quick", action="store_true", help=f"CPU smoke shapes: {QUICK}")
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.recompile_limit = 64  # each case compiles flex_attention anew; past the limit it runs eager
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {k: getattr(args, k) for k in ("rows", "context", "heads", "kv_heads", "head_dim", "layers", "vocab")},
        "copy_bandwidth_gb_s": bandwidth / GB,
        "attention": attention_cases(args, device),
        "token_choice": token_choice_cases(args, device),
    }
    print_results(results, bandwidth, args.layers)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def attention_cases(args: argparse.Namespace, device: torch.device) -> dict[str, dict[str, float]]:
    """Each way's median seconds a call, its rate of live KV bytes, and its largest difference from sdpa's output."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows, context, kv_heads, dim = args.rows, args.context, args.kv_heads, args.head_dim
    keys, values = torch.randn(2, rows, kv_heads, context, dim, device=device, dtype=dtype)
    query = torch.randn(rows, args.heads, 1, dim, device=device, dtype=dtype)
    scale = dim**-0.5
    live_bytes = 2 * keys.numel() * keys.element_size()

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True).transpose(1, 2)

    reference = dense()
    cases = {"sdpa over contiguous KV": {**_timed(dense, args, device), "max_abs_diff": 0.0}}
    lengths = torch.full((rows,), context, device=device)
    for block_tokens, options in _flex_cases(args.block_tokens):
        pool_keys, pool_values, table, pool_blocks = _paged(keys, values, block_tokens)
        bucket = row_bucket(rows)
        seen_keys, seen_values = pool_sequence(pool_keys, bucket), pool_sequence(pool_values, bucket)

        def mask(table=table, pool_blocks=pool_blocks, block_tokens=block_tokens) -> Any:
            return paged_block_mask(table, lengths, 1, pool_blocks, block_tokens)

        block_mask = mask()

        def flex(seen_keys=seen_keys, seen_values=seen_values, block_mask=block_mask, options=options) -> torch.Tensor:
            return paged_attention(
                query, seen_keys, seen_values, block_mask, scale, compiled=True, kernel_options=options
            )

        difference = float((flex().float() - reference.float()).abs().max())
        settings = "".join(f", {key} {value}" for key, value in (options or {}).items())
        cases[f"flex, {block_tokens}-token blocks{settings}"] = {
            **_timed(flex, args, device),
            "max_abs_diff": difference,
        }
        if options is None:
            cases[f"block mask build, {block_tokens}-token blocks"] = _timed(mask, args, device)
    for name, case in cases.items():
        if not name.startswith("block mask"):
            case["live_kv_gb_s"] = live_bytes / case["seconds"] / GB
    return cases


def _flex_cases(block_sizes: list[int]) -> list[tuple[int, dict[str, int] | None]]:
    """Each block size with inductor's default decode kernel settings; the first also with deeper pipelines
    (flex_attention's `kernel_options`: its decode kernel loads one block at a time, without overlap, by default)."""
    first = [(block_sizes[0], options) for options in PIPELINES]
    return [(block_sizes[0], None), *first, *((size, None) for size in block_sizes[1:])]


def _paged(
    keys: torch.Tensor, values: torch.Tensor, block_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The rows' keys and values moved into a pool of `block_tokens`-slot blocks in shuffled order ([slots, kv_heads,
    dim] each, a spare block per row as a running pool has), and the rows' block tables."""
    rows, kv_heads, context, dim = keys.shape
    blocks = -(-context // block_tokens)
    pool_blocks = rows * (blocks + 1)
    order = torch.randperm(pool_blocks, device=keys.device)[: rows * blocks].view(rows, blocks)
    slots = (order.unsqueeze(-1) * block_tokens + torch.arange(block_tokens, device=keys.device)).flatten(1)
    slots = slots[:, :context]  # [rows, context]: where each token lives
    pools = []
    for tensor in (keys, values):
        pool = torch.zeros(pool_blocks * block_tokens, kv_heads, dim, device=keys.device, dtype=keys.dtype)
        pool[slots.flatten()] = tensor.transpose(1, 2).reshape(rows * context, kv_heads, dim)
        pools.append(pool)
    return pools[0], pools[1], order, pool_blocks


def token_choice_cases(args: argparse.Namespace, device: torch.device) -> dict[str, dict[str, float]]:
    """The sampler's token choice at each top-p, with entropies (maxrl_gtpo_sepa's), median seconds a call."""
    logits = torch.randn(args.rows, args.vocab, device=device)
    uniforms = torch.rand(args.rows, device=device)
    cases = {}
    for top_p in (1.0, 0.95):
        sampling = SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p)
        cases[f"top_p {top_p}"] = _timed(lambda s=sampling: choose_tokens(logits, s, uniforms, True), args, device)
    return cases


def _timed(call: Callable[[], Any], args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Median seconds a call over `args.repeats` runs of `args.calls` calls, after two untimed (compiling) calls."""
    call(), call()
    runs = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.calls):
                call()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1e3 / args.calls)
        else:
            began = time.perf_counter()
            for _ in range(args.calls):
                call()
            runs.append((time.perf_counter() - began) / args.calls)
    return {"seconds": statistics.median(runs)}


def print_results(results: dict[str, Any], bandwidth: float, layers: int) -> None:
    shape = results["shape"]
    print(
        f"{results['device']}: {shape['rows']} rows × {shape['context']} tokens of KV, heads {shape['heads']}/"
        f"{shape['kv_heads']} × {shape['head_dim']}; copy bandwidth {bandwidth / GB:,.0f} GB/s"
    )
    print(f"| attention, one layer | µs a call | × {layers} layers, ms | live KV GB/s | of copy bandwidth | max |Δ| |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, case in results["attention"].items():
        seconds, rate = case["seconds"], case.get("live_kv_gb_s")
        cells = [f"{seconds * 1e6:,.1f}", f"{seconds * layers * 1e3:,.2f}"]
        cells += ["", ""] if rate is None else [f"{rate:,.0f}", f"{rate * GB / bandwidth:.1%}"]
        cells.append(f"{case['max_abs_diff']:.2g}" if "max_abs_diff" in case else "")
        print(f"| {name} | {' | '.join(cells)} |")
    print(f"| token choice, [{shape['rows']}, {shape['vocab']}] fp32, with entropies | µs a call |")
    print("|---|---:|")
    for name, case in results["token_choice"].items():
        print(f"| {name} | {case['seconds'] * 1e6:,.1f} |")


if __name__ == "__main__":
    main()
