"""Shared test helpers: run the real CLI (in a subprocess, or in this process) and read what a run wrote."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hypothesis import settings

from tests.scheduling import SharedScheduling

# CI explores the same examples every run (a red CI is then reproducible); locally they vary.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many worker processes `-n auto` (pyproject's addopts) starts: two, for the default suite and the slow
    one alike. Most of a default test is one core's imports and Python; most of a slow one is a one-thread CLI run
    (`run_cli`) or a wait on a server, a SLURM job or a time limit, which the other worker overlaps."""
    return 2


@pytest.hookimpl(tryfirst=True)  # before xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> SharedScheduling | None:
    """`--dist loadscope` (pyproject) with this suite's units of work: tests/scheduling.py."""
    return SharedScheduling(config, log) if config.getvalue("dist") == "loadscope" else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first (xdist keeps the order: `--no-loadscope-reorder`), so that a session of both kinds starts
    its longest work at once and ends on short tests, with neither worker left idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def one_torch_thread() -> None:
    """Each test's own torch ops run on one thread. The two workers share the two cores with the runs their tests
    start: torch's default of one thread per core put a spinning OpenMP thread on a core another process needed, and
    the in-process sampler tests took ~1.9× as long (tests/inference: 281 s against 146 s). A run started in this
    process (`cli_here`) still chooses its own count; a test that needs another sets it."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With RETRAIN_FAILURE_LOG set, each failure's traceback is appended to that file as it happens: pytest
    prints them at the end, which a run cut by its time limit (a lent GPU's call) never reaches."""
    path = os.environ.get("RETRAIN_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller writes, once
        with open(path, "a") as log:
            log.write(f"== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


# The offline demo, cut to what a test of the run itself needs: no held-out evaluation, one reward worker, a quiet
# console. Tests add what they vary (steps, batch shape, checkpoints) after it.
QUICK = [
    "experiment=quickstart",
    "eval.num_examples=0",
    "scoring.workers=1",
    "logging.console_groups=0",
    "logging.progress_bar=false",
]
SMALL_BATCH = ["training.batch_size=4", "training.group_size=4"]  # four prompts of four completions per step

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def cli_env(one_thread: bool = True) -> dict[str, str]:
    """The environment of a CLI run: tests/ importable; one OpenMP thread, or retrain's default (one per usable
    CPU, whatever the load: runs compared bit for bit get the same count)."""
    inherited = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return {
        **inherited,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **({"OMP_NUM_THREADS": "1"} if one_thread else {}),
    }


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    check: bool = True,
    one_thread: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m retrain ...` as a user would (tests/ importable for plugins).

    `one_thread` (OMP_NUM_THREADS=1) keeps a run's speed steady on a busy machine, where two OpenMP
    threads on a shared core are many times slower; the reproducibility tests run with one thread per
    usable CPU instead, as users on a quiet machine do (docs/reproducibility.md).
    """
    full_env = {**cli_env(one_thread), **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "retrain", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    return checked(result) if check else result


def checked(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """`result`, or an AssertionError with the end of its output when the command failed."""
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(result.args)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return result


CliHere = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli_here(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> CliHere:
    """`retrain ...` run by its real entry point in this process: `run_cli` without a new interpreter's
    5-7 s of imports, for a test of what the console shows and the exit code. Not for a run whose outcome
    depends on a fresh process (its thread count, its signals, settings read when a library is imported)."""

    def run(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        from retrain.cli import main

        root = logging.getLogger()
        handlers, level, environment = list(root.handlers), root.level, dict(os.environ)
        with monkeypatch.context() as patched:
            patched.chdir(cwd)
            patched.setattr(sys, "path", list(sys.path))  # main() puts the working directory on it, as Python would
            patched.setattr(sys, "argv", ["retrain", *args])
            capfd.readouterr()
            try:
                code = main(args)
            except SystemExit as exit:
                code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
            finally:  # what Hydra set up for the run: its log handlers (run.log stays open otherwise), its state
                for handler in set(root.handlers) - set(handlers):
                    handler.close()
                root.handlers[:], root.level = handlers, level
                HydraConfig.instance().cfg = None
                GlobalHydra.instance().clear()
                os.environ.clear()  # and what a `.env` file in `cwd` added
                os.environ.update(environment)
        result = subprocess.CompletedProcess(["retrain", *args], code, *capfd.readouterr())
        return checked(result) if check else result

    return run


def sigkill_once_checkpointed(args: list[str], cwd: Path, checkpoint: Path, timeout: float = 300) -> None:
    """Start `python -m retrain ...` with one thread per usable CPU and SIGKILL it as soon as `checkpoint`
    exists: the run dir is left as a crash or a preempted job leaves it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "retrain", *args],
        cwd=cwd,
        env=cli_env(one_thread=False),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + timeout
    while time.time() < deadline and not checkpoint.is_dir():
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def without_timing(records: list[dict]) -> list[dict]:
    """Metrics minus wall-clock fields (they end in `_s`), for reproducibility comparisons."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in records]


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data sets not found at {SHARED_DATA}")
    return SHARED_DATA
