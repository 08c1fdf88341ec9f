"""Reward plugins as users write them (good and buggy), plugged in by `reward._target_=...`.

Each misbehaves only on completions that contain a trigger word, so one call can mix good rows
with bad ones.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from typing import Any

from retrain.reward.checks import NoVerdict
from retrain.reward.match import match_reward


def my_reward(response: str, reference: str, **extra: Any) -> float:
    """1.0 when the reference appears anywhere in the response."""
    return 1.0 if reference and reference in response else 0.0


def subject_reward(response: str, reference: str, *, subject: str = "", **extra: Any) -> float:
    """Reads the example's `extra`: 1.0 for algebra problems only."""
    return 1.0 if subject == "algebra" else 0.0


async def async_reward(response: str, reference: str, **extra: Any) -> float:
    """Waits like a remote verifier would (0.2 s), then checks containment; "hang" never answers."""
    await asyncio.sleep(3600 if "hang" in response else 0.2)
    return 1.0 if reference in response else 0.0


class LibraryTimeout(BaseException):
    """Some libraries (math-verify among them) signal their timeouts with a BaseException."""


async def blocking_async_reward(response: str, reference: str, **extra: Any) -> float:
    """A common async bug: a blocking call inside `async def` stalls the whole event loop."""
    if "hang" in response:
        time.sleep(3600)
    return 1.0


def flaky_reward(response: str, reference: str, **extra: Any) -> float:
    if "boom" in response:
        raise RuntimeError("boom")
    if "stall" in response:
        raise LibraryTimeout("gave up")
    return 1.0


def hanging_reward(response: str, reference: str, **extra: Any) -> float:
    if "hang" in response:
        time.sleep(3600)
    return 1.0


def crashing_reward(response: str, reference: str, **extra: Any) -> float:
    if "crash" in response:
        os._exit(3)  # a native library taking the process down
    return 1.0


def nan_reward(response: str, reference: str, **extra: Any) -> float:
    return float("nan") if "nan" in response else 1.0


def list_reward(response: str, reference: str, **extra: Any) -> Any:
    return [1.0, 0.0] if "list" in response else 1.0


def string_reward(response: str, reference: str, **extra: Any) -> Any:
    return "1.0" if "string" in response else 1.0


class ScaledMatchReward:
    """A class-based reward: configured in __init__ (`_partial_: false`), called per completion."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    def __call__(self, response: str, reference: str, **extra: Any) -> float:
        return self.scale * match_reward(response, reference)


def overflowing_reward(response: str, reference: str, **extra: Any) -> Any:
    """Bug: an unbounded score. `10**400` is no float at all; `1e308` is a float64 but inf as a float32."""
    return {"int": 10**400, "float": 1e308}.get(response, 1.0)


def verbose_reward(response: str, reference: str, **extra: Any) -> float:
    """Prints a megabyte per completion (stdout and stderr) and raises a megabyte-long message on "boom"."""
    print("v" * 2**20)
    os.write(2, b"w" * 2**20)  # below Python, as a native library would
    if "boom" in response:
        raise RuntimeError("e" * 2**20)
    return 1.0


def undecided_reward(response: str, reference: str, **extra: Any) -> float:
    """Gives no verdict on "undecided" (as a judge whose server is down does); scores the rest."""
    if "undecided" in response:
        raise NoVerdict("the verifier is unavailable")
    return 1.0 if reference in response else 0.0


_HELD: list[bytes] = []


def memory_hog_reward(response: str, reference: str, **extra: Any) -> float:
    """Holds on to 128 MB on "hog" (a leak); scores every completion with the id of the worker process."""
    if "hog" in response:
        _HELD.append(b"m" * (128 << 20))
    return float(os.getpid())


def forking_reward(response: str, reference: str, *, pid_dir: str = "", **extra: Any) -> float:
    """Starts a helper process that outlives the call (a sandbox, a server) and records its pid; "hang" then hangs."""
    helper = subprocess.Popen(["sleep", "3600"])
    with open(os.path.join(pid_dir, f"{helper.pid}.pid"), "w") as handle:
        handle.write(str(helper.pid))
    if "hang" in response:
        time.sleep(3600)
    return 1.0
