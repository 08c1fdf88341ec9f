"""The torch switches a run sets for bit-exact reruns, and that they end with the run."""

from __future__ import annotations

import os

import pytest
import torch

from retrain.housekeeping.determinism import CUBLAS_WORKSPACE_CONFIG, reproducible_torch


def deterministic_mode() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def test_a_cpu_run_uses_deterministic_kernels_and_gives_the_settings_back() -> None:
    before = deterministic_mode(), torch.utils.deterministic.fill_uninitialized_memory
    with reproducible_torch(False, torch.device("cpu")):
        assert deterministic_mode() == (True, True)
        assert not torch.utils.deterministic.fill_uninitialized_memory  # no NaN fill of each fresh torch.empty
    assert (deterministic_mode(), torch.utils.deterministic.fill_uninitialized_memory) == before


def test_a_gpu_run_keeps_the_fast_kernels_unless_asked() -> None:
    before = deterministic_mode()
    with reproducible_torch(False, "cuda:0"):
        assert deterministic_mode() == before


def test_training_deterministic_is_strict_and_fixes_the_cublas_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = deterministic_mode(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    with reproducible_torch(True, "cuda:0"):
        assert deterministic_mode() == (True, False)
        assert torch.utils.deterministic.fill_uninitialized_memory  # torch's full guarantee
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    assert (deterministic_mode(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == before


def test_the_parallel_kernel_it_replaces_is_the_reason() -> None:
    """The backward of advanced indexing (a KV cache repeated per row) adds atomically across threads;
    in deterministic mode it adds in a fixed order, so repeated backwards agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(0)
        cache = torch.randn(8, 2, 40, 64, generator=generator, requires_grad=True)
        rows = torch.randperm(64, generator=generator) // 8
        upstream = torch.randn(64, 2, 40, 64, generator=generator)

        def gradient() -> torch.Tensor:
            cache.grad = None
            cache[rows].backward(upstream)
            assert cache.grad is not None
            return cache.grad.clone()

        with reproducible_torch(False, "cpu"):
            first = gradient()
            assert all(torch.equal(first, gradient()) for _ in range(20))
    finally:
        torch.set_num_threads(threads)
