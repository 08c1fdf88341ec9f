"""keep_freed_memory: a training-like step stops faulting its memory in anew each time (glibc, Linux)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap

import pytest

STEPS = textwrap.dedent(
    """
    import resource, sys, torch
    from retrain.housekeeping.allocator import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 1536) for _ in range(4)] + [torch.nn.Linear(1536, 64)]

    def step():  # activations of ~12 MB each, freed after the backward, as in a training step (thin layers: little compute)
        x = torch.randn(2048, 64)
        hidden = sum(torch.nn.functional.silu(layer(x)) for layer in layers[:4])
        layers[4](hidden).square().mean().backward()

    for _ in range(3):  # the first steps fault their memory in either way
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def page_faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True).stdout
    kept, faults = out.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_steps_reuse_the_memory_they_freed_instead_of_faulting_it_in_again():
    """Medians of three processes per mode: one process's count moves with glibc's history (seen: 1-14k pages kept,
    39-113k by default; one pair of single runs came to only 2.8x)."""
    runs = {mode: [page_faults(mode) for _ in range(3)] for mode in ("keep", "default")}
    assert all(kept == "True" for kept, _ in runs["keep"])
    kept_faults, default_faults = (
        statistics.median(faults for _, faults in runs[mode]) for mode in ("keep", "default")
    )
    assert default_faults > 20_000  # glibc's defaults: thousands of fresh pages in most steps
    assert kept_faults * 4 < default_faults
