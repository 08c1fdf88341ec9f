"""torch's thread count: the CPUs the process may use (affinity, cgroup quota, SLURM, a local sweep's share)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig

from retrain.config import compose
from retrain.housekeeping.threads import cgroup_cpu_quota, choose_threads, passive_openmp_waits, usable_cpus
from retrain.run import local_sweep_job_cpus
from tests.conftest import REPO, run_cli

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    """A cgroup file tree as the kernel shows it (the files the quota is read from)."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({}, None),
    ],
)
def test_the_cgroup_quota_in_cpus(tmp_path: Path, files: dict[str, str], quota: int | None) -> None:
    assert cgroup_cpu_quota(cgroup(tmp_path, files), own_cgroup=tmp_path / "none") == quota


def test_the_quota_of_the_process_own_cgroup_comes_first(tmp_path: Path) -> None:
    root = cgroup(tmp_path, {"cpu.max": "max 100000\n", "jobs/42/cpu.max": "100000 100000\n"})
    (tmp_path / "self_cgroup").write_text("0::/jobs/42\n")
    assert cgroup_cpu_quota(root, own_cgroup=tmp_path / "self_cgroup") == 1


def test_the_tightest_limit_decides(tmp_path: Path) -> None:
    no_quota = cgroup(tmp_path / "none", {"cpu.max": "max 100000\n"})
    one_cpu = cgroup(tmp_path / "one", {"cpu.max": "100000 100000\n"})
    assert usable_cpus({}, no_quota) == (AFFINITY, "CPU affinity")
    assert usable_cpus({"SLURM_CPUS_PER_TASK": "1"}, no_quota) == (1, "SLURM_CPUS_PER_TASK")
    assert usable_cpus({"SLURM_CPUS_PER_TASK": str(AFFINITY + 8)}, no_quota) == (AFFINITY, "CPU affinity")
    if AFFINITY > 1:
        assert usable_cpus({}, one_cpu) == (1, "cgroup CPU quota")
        assert usable_cpus({}, no_quota, job_cpus=1)[0] == 1  # a local sweep job's share


def test_training_threads_then_the_environment_override_the_choice(tmp_path: Path) -> None:
    root = cgroup(tmp_path, {"cpu.max": "100000 100000\n"})
    assert choose_threads(3, {"OMP_NUM_THREADS": "2"}, root).line() == "torch threads: 3 (training.threads=3)"
    assert choose_threads(0, {"OMP_NUM_THREADS": "2"}, root).line() == "torch threads: 2 (OMP_NUM_THREADS=2)"
    assert choose_threads(0, {}, root).threads == 1


def test_openmp_waits_passively_unless_the_environment_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    passive_openmp_waits()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    # the policy is read once, when torch loads: the command line must set it before anything imports torch
    check = "import sys, retrain.cli; assert 'torch' not in sys.modules, 'retrain.cli imports torch'"
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True)


def test_a_run_logs_its_thread_count_and_why(tmp_path: Path) -> None:
    fails_early = ["experiment=quickstart", "data=jsonl", "data.path=missing.jsonl"]  # after the threads are set
    for extra, line in [
        ([], "torch threads: 1 (OMP_NUM_THREADS=1)"),
        (["training.threads=2"], "torch threads: 2 (training.threads=2)"),
    ]:
        result = run_cli([*fails_early, *extra, f"hydra.run.dir={tmp_path / str(len(extra))}"], tmp_path, check=False)
        assert line in result.stdout, result.stdout
    result = run_cli([*fails_early, f"hydra.run.dir={tmp_path / 'auto'}"], tmp_path, check=False, one_thread=False)
    assert "torch threads: " in result.stdout and "usable CPU(s), limited by" in result.stdout, result.stdout


@pytest.mark.parametrize(("launcher", "cpus"), [("local", 1), ("slurm", None), (None, None)])
def test_a_local_sweep_job_gets_its_launchers_cpus_per_task(launcher: str | None, cpus: int | None) -> None:
    """hydra/launcher=local runs a sweep's jobs side by side on this machine: each gets `cpus_per_task`."""
    config = compose([f"hydra/launcher={launcher}"] if launcher else [], return_hydra_config=True)
    HydraConfig.instance().set_config(config)
    try:
        assert local_sweep_job_cpus() == cpus
    finally:
        HydraConfig.instance().cfg = None
