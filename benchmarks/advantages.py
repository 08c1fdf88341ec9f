"""Vectorized token advantages against a plain per-sequence Python implementation (a script, not a test).

    python benchmarks/advantages.py [--threads 2] [--repeats 30] [--python-repeats 3] [--tokens 10240]

One full-size step: B=8 prompts x G=16 completions x T=10240 tokens (1.3M tokens), MaxRL episode
advantages, GTPO, and SEPA pooling (lambda 0.5) or HICRA, with the step's uncertainty metrics.
The baseline is the test suite's oracle (tests/algorithm/reference.py): the same formulas applied
completion by completion on Python lists, the way the original tool did; both results are compared
before any time is reported. Times are the best
of several runs: on a shared machine, other processes only ever make a run slower. With
--threads 2, both cores must be idle (a busy core stalls every parallel kernel).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the oracle lives in tests/, run from a checkout

from retrain.config import compose
from tests.algorithm import reference

T = TypeVar("T")
BATCH, GROUP = 8, 16
BETA, ALPHA, LAMBDA = 0.1, 0.2, 0.5  # the presets' GTPO beta and HICRA alpha; SEPA's lambda once ramped


def synthetic_step(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random rewards, log-probs and ~5 % planning tokens in 3-token runs; every token is real."""
    generator = torch.Generator().manual_seed(seed)
    rows = BATCH * GROUP
    rewards = (torch.rand(BATCH, GROUP, generator=generator) < 0.4).float()
    logprobs = torch.log(torch.rand(rows, tokens, generator=generator).clamp_min(1e-6))
    starts = torch.rand(rows, tokens, generator=generator) < 0.017
    planning = starts | starts.roll(1, dims=1) | starts.roll(2, dims=1)
    return {
        "rewards": rewards,
        "logprobs": logprobs,
        "mask": torch.ones(rows, tokens, dtype=torch.bool),
        "planning": planning,
    }


def reference_step(
    rewards: list[list[float]], logprobs: list[list[float]], planning: list[list[bool]], transform: str
) -> tuple[list[list[float]], dict[str, float]]:
    """The test oracle on the step: token advantages and the uncertainty metrics, completion by completion."""
    lam = LAMBDA if "sepa" in transform else 0.0
    advantages = reference.token_advantages(
        advantage="maxrl",
        transform=transform,
        rewards=rewards,
        logprobs=logprobs,
        planning=planning,
        entropies=None,
        lam=lam,
        beta=BETA,
        alpha=ALPHA,
    )
    return advantages, reference.uncertainty_moments(transform=transform, logprobs=logprobs, planning=planning, lam=lam)


def vectorized(name: str):
    algorithm = instantiate(
        compose(
            [
                f"algorithm={name}",
                "algorithm.sepa.delay_steps=0",
                "algorithm.sepa.steps=2",
                "algorithm.sepa.correct_rate_gate=0",
            ]
        ).algorithm
    )
    assert algorithm.begin_step(1) == {"sepa_lambda": LAMBDA if "sepa" in name else 0.0}
    return algorithm


def best_of(repeats: int, fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    """The fastest of `repeats` timed calls of fn(*args), and its result."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - started)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of the vectorized step (best kept)")
    parser.add_argument("--python-repeats", type=int, default=3, help="timed runs of the reference (best kept)")
    parser.add_argument("--tokens", type=int, default=10240)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    step = synthetic_step(args.tokens)
    total = int(step["mask"].sum())
    lists = (step["rewards"].tolist(), step["logprobs"].tolist(), step["planning"].tolist())
    print(f"B={BATCH} G={GROUP} T={args.tokens}: {total:,} tokens, torch threads={args.threads}")
    print(f"{'algorithm':<18}{'vectorized ms':>15}{'tokens/s':>14}{'python s':>10}{'speed-up':>10}")
    for name, transform in (("maxrl_gtpo_sepa", "gtpo_sepa"), ("maxrl_gtpo_hicra", "gtpo_hicra")):
        algorithm = vectorized(name)
        fast_s, output = best_of(
            args.repeats, algorithm.compute, step["rewards"], step["logprobs"], step["mask"], None, step["planning"]
        )
        slow_s, (expected, metrics) = best_of(args.python_repeats, reference_step, *lists, transform)
        torch.testing.assert_close(output.token_advantages, torch.tensor(expected), rtol=1e-4, atol=1e-5)
        for key, value in metrics.items():
            got = output.metrics[f"surprisal/{key}"]
            assert math.isclose(got, value, rel_tol=1e-4, abs_tol=1e-6), (key, got, value)
        print(f"{name:<18}{1000 * fast_s:>15.1f}{total / fast_s:>14,.0f}{slow_s:>10.2f}{slow_s / fast_s:>9.0f}x")


if __name__ == "__main__":
    main()
