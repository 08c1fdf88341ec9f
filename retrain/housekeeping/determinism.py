"""Bit-exact reruns: the torch switches a run sets so that the same seed gives the same metrics.

On CPU the one nondeterministic kernel on retrain's path is the backward of advanced indexing
(`cache[indices]`, which repeats each prompt's KV cache for the rows of its group): with more than
one thread torch accumulates it with atomic float adds, whose order varies from run to run.
torch's deterministic mode makes it serial, which costs nothing measurable at the sizes involved,
so a CPU run always uses it (warn_only: an op with no deterministic kernel warns instead of failing).
That mode also fills every fresh `torch.empty` with NaN, a guard against kernels that read memory
they never wrote; retrain's do not (the reruns prove it), and the fill cost ~1.5% of the quickstart
step, so the CPU default leaves it off. `training.deterministic=true` keeps torch's full guarantee.
On CUDA the deterministic kernels (attention backward, index_add, ...) cost real time, so they are
opt-in: `training.deterministic=true`. What is and is not bit-exact: docs/reproducibility.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# cuBLAS is bit-repeatable only with a fixed workspace configuration (NVIDIA's cuBLAS docs, "Results
# reproducibility"); torch's deterministic mode refuses CUDA matmuls without one.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


@contextmanager
def reproducible_torch(deterministic: bool, device: torch.device | str | None) -> Iterator[None]:
    """Within the block: deterministic kernels on CPU always, everywhere when `deterministic` (strict:
    an op with no deterministic kernel raises). Enter it before the first CUDA matmul (cuBLAS reads
    its workspace setting once); the previous settings come back on exit (a sweep runs in one process)."""
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]  # a module property
    )
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    elif device is not None and torch.device(device).type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous[2], previous[3]
        torch.utils.deterministic.fill_uninitialized_memory = previous[4]  # type: ignore[attr-defined]
