"""Print the memory plan and tables of docs/capacity-planning.md ("Memory") from the memory plan itself.

    python scripts/memory_table.py

The default run (Qwen3-4B-Instruct-2507, rank-32 LoRA, 8 prompts × 16 completions of up to 10,240 tokens,
inference=pytorch) planned on each GPU size of retrain.model.memory_plan.GPU_SIZES_GB, and with each knob.
tests/test_memory_plan.py checks the page holds exactly these lines, so the page cannot drift from the plan.
"""

from __future__ import annotations

import functools
from typing import Any

from omegaconf import OmegaConf

from retrain.config import compose
from retrain.model.memory_plan import GIB, GPU_SIZES_GB, MemoryPlan, plan_for

GB = 10**9
# (what the row shows, the overrides it plans) beside the default run
KNOB_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("default (checkpointing auto, KV automatic)", ()),
    ("`backend.gradient_checkpointing=false`", ("backend.gradient_checkpointing=false",)),
    ("`backend.gradient_checkpointing=true`", ("backend.gradient_checkpointing=true",)),
    ("`backend.micro_batch_tokens=32768` (3 rows a forward)", ("backend.micro_batch_tokens=32768",)),
    ("`inference.kv_cache_gb=16`", ("inference.kv_cache_gb=16",)),
)


@functools.cache
def composed(overrides: tuple[str, ...]) -> Any:
    return OmegaConf.to_container(compose(list(overrides)), resolve=True)


def planned(overrides: tuple[str, ...], size_gb: int) -> MemoryPlan:
    plan = plan_for(composed(overrides), [size_gb * GB], on_gpu=True)
    assert plan is not None
    return plan


def cell(plan: MemoryPlan) -> str:
    """One GPU size's verdict: the peak and rows decoding at once when it fits, else the knob."""
    device = plan.devices[0]
    if not plan.fits:
        return f"does not fit ({device.peak_bytes / GIB:.0f} GiB)"
    return f"{device.peak_bytes / GIB:.1f} GiB, {plan.rows_at_once} rows"


def tables() -> str:
    """The two markdown tables the page shows."""
    lines = [
        "| GPU | checkpointing (auto) | KV budget | rows at full length at once | waiting | activations | peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in GPU_SIZES_GB:
        plan = planned((), size)
        device = plan.devices[0]
        activations = next(part for part in device.parts if part.name.startswith("activations"))
        lines.append(
            f"| {size} GB | {'on' if plan.checkpointing else 'off'} | {plan.kv_budget_bytes / GIB:.1f} GiB | "
            f"{plan.rows_at_once} of {plan.inputs.rows} | {plan.inputs.rows - plan.rows_at_once} | "
            f"{activations.bytes / GIB:.1f} GiB | {device.peak_bytes / GIB:.1f} GiB |"
        )
    lines += ["", "| knobs | " + " | ".join(f"{size} GB" for size in GPU_SIZES_GB) + " |"]
    lines.append("|---" * (len(GPU_SIZES_GB) + 1) + "|")
    for label, overrides in KNOB_ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(planned(overrides, size)) for size in GPU_SIZES_GB) + " |")
    return "\n".join(lines)


def example() -> str:
    """The default run's plan on an 80 GB GPU, as `retrain explain` prints it."""
    return planned((), 80).table()


if __name__ == "__main__":
    print(example(), tables(), sep="\n\n")
