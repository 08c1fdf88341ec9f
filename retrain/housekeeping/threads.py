"""How many threads torch computes with, and how OpenMP's idle threads wait.

torch starts one thread per core of the machine. Where the process may use fewer — a CPU affinity
(`taskset`, a container's cpuset), a cgroup CPU quota (Docker `--cpus`, Kubernetes limits), a SLURM
allocation (`SLURM_CPUS_PER_TASK`), or a local sweep whose jobs run side by side
(`hydra/launcher=local`, `cpus_per_task` each) — the extra threads only wait for CPUs that are taken,
and every parallel region waits for its slowest thread. retrain takes the smallest of those limits;
`training.threads=N` or `OMP_NUM_THREADS=N` in the environment decide instead (a variable that holds no
whole number > 0 in ASCII digits, `²` say, is ignored with a warning, as OpenMP ignores it). The count
depends on nothing else, so a run and its resume compute with the same count, and a seed gives the same
numbers whatever else the machine is doing (docs/reproducibility.md).

How the threads wait follows the load. OpenMP's idle threads spin a few milliseconds before they sleep:
with a free CPU each, the next parallel region starts at once (sleeping instead made the quickstart's
step 3× slower); on a CPU another process keeps busy, the spinning takes the CPU from the thread that
has work (a step up to 200× slower). So the usable CPUs that are idle over a short sample of /proc/stat at the
start (`IDLE_SAMPLE_S`) decide: the threads keep OpenMP's default when each has an idle CPU, and
`OMP_WAIT_POLICY=PASSIVE` (sleep at once) when they do not. The waiting never changes a number. The
OpenMP runtime reads the policy once, when torch loads, so the command line sets it first
(`set_openmp_waits`), unless the environment sets it; it knows `training.threads` there only as an
override on the command line (the run's log says when the policy came too late). A load that starts
after the run does is not seen. Measurements: benchmarks/threads.py, docs/benchmarks.md.

`set_torch_threads` calls `torch.set_num_threads` only when the count differs from torch's own: the call, even with the count
torch has, also turns MKL's dynamic threading off for good, and MKL's small matrix products inside torch's
parallel ops (CPU attention's) then compete for the cores: ~4× slower attention on the tiny model, 72 → 53 ms a
quickstart step without the call (docs/benchmarks.md, "The CPU step won back"). Where the count does change
(fewer usable CPUs than cores), that cost remains: torch offers no way to set the count without it.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from retrain.housekeeping.digits import whole_number

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_STAT = Path("/proc/stat")
IDLE_SAMPLE_S = 0.2  # /proc/stat counts in 10 ms ticks: 20 per CPU
IDLE_BELOW = 0.5  # a CPU busy less than half the sample is free for a thread; a compute job keeps one busy ~100%
SPIN = "spin while they wait (OpenMP's default)"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # what decided it, for the run's log
    waits: str = SPIN  # how OpenMP's idle threads wait

    def line(self) -> str:
        return f"torch threads: {self.threads} ({self.reason}); OpenMP threads {self.waits}"


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
    slurm = positive_setting(environ, "SLURM_CPUS_PER_TASK")
    if slurm is not None:
        limits.append((slurm, "SLURM_CPUS_PER_TASK"))
    if job_cpus is not None and job_cpus > 0:
        limits.append((job_cpus, "each parallel local sweep job's hydra.launcher.cpus_per_task"))
    cpus, source = min(limits, key=lambda limit: limit[0])
    return cpus, source


def positive_setting(environ: Mapping[str, str], name: str) -> int | None:
    """A count > 0 the environment sets (OMP_NUM_THREADS, SLURM_CPUS_PER_TASK); None when unset or not one."""
    count = whole_number(environ.get(name, ""))
    return count if count else None


def ignored_settings(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The thread settings of the environment that are set but are no count > 0 (`²`, `four`, `0`): each is
    ignored, as OpenMP ignores an OMP_NUM_THREADS it cannot read, with a warning that names it."""
    return [
        f"{name}={environ[name]!r} is not a whole number > 0: ignored"
        for name in THREAD_VARIABLES
        if environ.get(name, "").strip() and positive_setting(environ, name) is None
    ]


def cpu_ticks(stat: str) -> dict[int, tuple[int, int]]:
    """CPU number -> (busy ticks, all ticks) from the text of /proc/stat. Idle is `idle` + `iowait`;
    busy is the rest (`steal` included: a hypervisor's other guests had the CPU)."""
    ticks = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and whole_number(name[3:]) is not None):
            continue
        counts = [int(field) for field in fields[:8]]  # guest time is counted in user time already
        idle = sum(counts[3:5])
        ticks[int(name[3:])] = (sum(counts) - idle, sum(counts))
    return ticks


def idle_cpu_count(before: str, after: str, cpus: set[int], idle_below: float = IDLE_BELOW) -> int:
    """How many of `cpus` were busy less than `idle_below` of the time between two /proc/stat texts."""
    start, end = cpu_ticks(before), cpu_ticks(after)
    idle = 0
    for cpu in cpus & start.keys() & end.keys():
        busy, total = (end[cpu][0] - start[cpu][0]), (end[cpu][1] - start[cpu][1])
        idle += total <= 0 or busy / total < idle_below  # no tick counted: nothing ran there either
    return idle


@functools.cache
def idle_cpus_now(seconds: float = IDLE_SAMPLE_S, stat: Path = PROC_STAT) -> int | None:
    """How many CPUs of this process's affinity are idle now, sampled over `seconds` (None without
    /proc/stat). Once per process: the load its own first run found, not the load it makes itself."""
    try:
        before = stat.read_text()
        time.sleep(seconds)
        after = stat.read_text()
    except OSError:
        return None
    return idle_cpu_count(before, after, os.sched_getaffinity(0))


def choose_threads(
    configured: int,
    environ: Mapping[str, str] = os.environ,
    cgroup_root: Path = CGROUP_ROOT,
    job_cpus: int | None = None,
    idle: int | None = None,
    torch_loaded: bool = False,
) -> ThreadChoice:
    """`training.threads` when set (> 0), else OMP_NUM_THREADS when set, else the usable CPUs (never the
    load: the count decides the numbers). More threads than `idle` CPUs (None: not known) sleep while
    they wait, unless OMP_WAIT_POLICY says otherwise or torch was loaded before it could be set."""
    omp = positive_setting(environ, "OMP_NUM_THREADS")
    if configured > 0:
        threads, reason = configured, f"training.threads={configured}"
    elif omp is not None:
        threads, reason = omp, f"OMP_NUM_THREADS={omp}"
    else:
        cpus, source = usable_cpus(environ, cgroup_root, job_cpus)
        threads = cpus
        found = "" if idle is None else f", {idle} idle at the start"
        reason = f"{cpus} usable CPU(s), limited by {source}{found}; training.threads=N sets it"
    sleeps = threads > 1 and idle is not None and threads > idle
    policy = environ.get("OMP_WAIT_POLICY")
    if sleeps and (policy == "PASSIVE" or (policy is None and not torch_loaded)):
        return ThreadChoice(threads, reason, f"sleep while they wait ({idle} idle CPU(s) for {threads} threads)")
    if policy:
        return ThreadChoice(threads, reason, f"wait as OMP_WAIT_POLICY={policy} says")
    if sleeps:
        return ThreadChoice(threads, reason, f"{SPIN}: torch was loaded before OMP_WAIT_POLICY could be set")
    return ThreadChoice(threads, reason)


def fitted_threads(configured: int, environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """This run's choice, on this machine now; the idle CPUs are sampled only where more than one
    thread could be chosen."""
    if configured == 1 or (configured <= 0 and positive_setting(environ, "OMP_NUM_THREADS") == 1):
        return choose_threads(configured, environ)
    idle = idle_cpus_now()
    return choose_threads(
        configured, environ, job_cpus=local_sweep_job_cpus(), idle=idle, torch_loaded="torch" in sys.modules
    )


def threads_override(args: list[str]) -> int:
    """`training.threads=N` among the command line's overrides (the last one), 0 without one: the command
    line decides OpenMP's wait policy before Hydra composes the config. A value that is no whole number (`²`)
    counts as none here; composing the config then refuses it, naming the key."""
    values = [arg.split("=", 1)[1] for arg in args if arg.lstrip("+").split("=", 1)[0] == "training.threads"]
    return (whole_number(values[-1]) or 0) if values else 0


def set_torch_threads(count: int) -> None:
    """torch computes with `count` threads; its thread pool is left alone when it has that many (see the module
    docstring: setting the same count again slows MKL inside torch's parallel ops)."""
    import torch  # not at the top: the command line uses this module before torch loads

    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


def set_openmp_waits(choice: ThreadChoice, environ: MutableMapping[str, str] = os.environ) -> None:
    """OMP_WAIT_POLICY=PASSIVE where `choice` says its threads sleep, unless set already; the command
    line calls it before torch loads (OpenMP reads it then)."""
    if choice.waits.startswith("sleep"):
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def local_sweep_job_cpus() -> int | None:
    """The CPUs each job of a local sweep gets (`hydra/launcher=local` runs them side by side); None elsewhere."""
    if not HydraConfig.initialized():
        return None
    launcher = HydraConfig.get().launcher
    if not str(launcher.get("_target_", "")).endswith("submitit_launcher.LocalLauncher"):
        return None
    cpus = launcher.get("cpus_per_task")
    return int(cpus) if cpus else None
