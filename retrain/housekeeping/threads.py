"""How many threads torch computes with: as many as the CPUs this process may really use.

torch starts one thread per core of the machine. Where the process may use fewer — a CPU affinity
(`taskset`, a container's cpuset), a cgroup CPU quota (Docker `--cpus`, Kubernetes limits), a SLURM
allocation (`SLURM_CPUS_PER_TASK`), or a local sweep whose jobs run side by side
(`hydra/launcher=local`, `cpus_per_task` each) — the extra threads only wait for CPUs that are busy, and
every parallel region waits for its slowest thread. retrain takes the smallest of those limits;
`training.threads=N` or `OMP_NUM_THREADS=N` in the environment decides instead.

OpenMP's idle threads spin before they sleep; on a core another process keeps busy, the spinning takes
the CPU from the thread that has work. `OMP_WAIT_POLICY=PASSIVE` makes them sleep at once. The OpenMP
runtime reads it once, when torch loads, so the command line sets it first (`passive_openmp_waits`),
unless the environment sets it. Measurements: benchmarks/threads.py, docs/benchmarks.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def passive_openmp_waits() -> None:
    """Idle OpenMP threads sleep rather than spin (see the module docstring); call before torch is imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # what decided it, for the run's log

    def line(self) -> str:
        return f"torch threads: {self.threads} ({self.reason})"


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, own_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """The CPUs a cgroup CPU quota allows (rounded up); None without a quota.

    cgroup v2: `cpu.max` ("max 100000", or "<quota> <period>") of this process's cgroup, or at the root;
    cgroup v1: `cpu/cpu.cfs_quota_us` (-1: none) over `cpu/cpu.cfs_period_us`.
    """
    candidates = []
    try:
        for line in own_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                candidates.append(root / line[3:].lstrip("/") / "cpu.max")
    except OSError:
        pass
    candidates.append(root / "cpu.max")
    for path in candidates:
        try:
            quota, period = path.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else _cpus(quota, period)
    try:
        quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _cpus(quota, period)


def _cpus(quota: str, period: str) -> int | None:
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus(
    environ: Mapping[str, str] = os.environ, cgroup_root: Path = CGROUP_ROOT, job_cpus: int | None = None
) -> tuple[int, str]:
    """(the CPUs this process may use, which limit says so): the smallest of its CPU affinity, its cgroup
    quota, SLURM_CPUS_PER_TASK and `job_cpus` (a local sweep job's share of the machine)."""
    limits = [(len(os.sched_getaffinity(0)), "CPU affinity")]
    if (quota := cgroup_cpu_quota(cgroup_root)) is not None:
        limits.append((quota, "cgroup CPU quota"))
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        limits.append((int(slurm), "SLURM_CPUS_PER_TASK"))
    if job_cpus is not None and job_cpus > 0:
        limits.append((job_cpus, "each parallel local sweep job's hydra.launcher.cpus_per_task"))
    cpus, source = min(limits, key=lambda limit: limit[0])
    return cpus, source


def choose_threads(
    configured: int,
    environ: Mapping[str, str] = os.environ,
    cgroup_root: Path = CGROUP_ROOT,
    job_cpus: int | None = None,
) -> ThreadChoice:
    """`training.threads` when set (> 0), else OMP_NUM_THREADS when set, else the usable CPUs."""
    if configured > 0:
        return ThreadChoice(configured, f"training.threads={configured}")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), f"OMP_NUM_THREADS={omp}")
    cpus, source = usable_cpus(environ, cgroup_root, job_cpus)
    return ThreadChoice(cpus, f"{cpus} usable CPU(s), limited by {source}; training.threads=N sets it")
