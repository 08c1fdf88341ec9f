"""torch's thread count: the CPUs the process may use (affinity, cgroup quota, SLURM, a local sweep's share)
that are idle at the start; OpenMP's threads sleep while they wait only when they outnumber the idle CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig

from retrain.config import compose
from retrain.housekeeping.threads import (
    PROC_STAT,
    SPIN,
    ThreadChoice,
    cgroup_cpu_quota,
    choose_threads,
    cpu_ticks,
    idle_cpu_count,
    ignored_settings,
    local_sweep_job_cpus,
    set_openmp_waits,
    threads_override,
    usable_cpus,
)
from tests.conftest import REPO, cli_env, run_cli

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


def stat(*cpus: tuple[int, int]) -> str:
    """/proc/stat as the kernel writes it, each CPU with (busy, idle) ticks: busy in user, idle half in iowait."""
    lines = [f"cpu  {sum(b for b, _ in cpus)} 0 0 {sum(i for _, i in cpus)} 0 0 0 0 0 0"]
    lines += [
        f"cpu{n} {busy - busy // 2} 0 {busy // 2} {idle - idle // 2} {idle // 2} 0 0 0 0 0"
        for n, (busy, idle) in enumerate(cpus)
    ]
    return "\n".join([*lines, "intr 12345 0 0", "ctxt 999", "btime 1700000000", "procs_running 2", ""])


def test_the_busy_and_idle_ticks_of_each_cpu() -> None:
    assert cpu_ticks(stat((30, 70), (5, 95))) == {0: (30, 100), 1: (5, 100)}
    steal = "cpu0 10 0 0 50 0 0 0 40 7 0\n"  # a hypervisor's other guests had the CPU 40 ticks; guest time is in user
    assert cpu_ticks(steal) == {0: (50, 100)}


@pytest.mark.parametrize(
    ("after", "cpus", "idle"),
    [
        (stat((120, 80), (10, 190)), {0, 1}, 1),  # CPU 0 busy the whole sample (a hog), CPU 1 idle
        (stat((120, 80), (10, 190)), {0}, 0),  # only the CPUs of this process's affinity count
        (stat((29, 91), (10, 190)), {0, 1}, 2),  # CPU 0 busy 9 ticks of 20: idle enough
        (stat((30, 90), (10, 190)), {0, 1}, 1),  # busy 10 of 20: taken
        (stat((20, 80), (10, 90)), {0, 1}, 2),  # no tick counted (a CPU that sleeps deeply): nothing ran there
        (stat((120, 80), (110, 90)), {0, 1, 2, 3}, 0),  # CPUs the kernel does not list are not there
    ],
)
def test_the_idle_cpus_between_two_samples(after: str, cpus: set[int], idle: int) -> None:
    assert idle_cpu_count(stat((20, 80), (10, 90)), after, cpus) == idle


def test_the_usable_cpus_decide_the_count_and_the_idle_ones_how_the_threads_wait(tmp_path: Path) -> None:
    """The count never follows the load (it decides the numbers a seed gives); the waiting does."""
    no_quota = cgroup(tmp_path, {"cpu.max": "max 100000\n"})
    quiet = choose_threads(0, {}, no_quota, idle=AFFINITY)
    assert (quiet.threads, quiet.waits) == (AFFINITY, SPIN)
    assert f"{AFFINITY} idle at the start" in quiet.reason
    for idle in (0, AFFINITY - 1, AFFINITY + 4, None):
        assert choose_threads(0, {}, no_quota, idle=idle).threads == AFFINITY
    busy = choose_threads(0, {}, no_quota, idle=AFFINITY - 1)
    assert busy.waits == (
        SPIN if AFFINITY == 1 else f"sleep while they wait ({AFFINITY - 1} idle CPU(s) for {AFFINITY} threads)"
    )
    assert choose_threads(0, {}, no_quota, idle=AFFINITY + 4).waits == SPIN  # idle CPUs outside the limits
    assert choose_threads(0, {"SLURM_CPUS_PER_TASK": "1"}, no_quota, idle=0) == ThreadChoice(
        1, "1 usable CPU(s), limited by SLURM_CPUS_PER_TASK, 0 idle at the start; training.threads=N sets it"
    )


def test_threads_set_by_hand_sleep_while_they_wait_when_they_outnumber_the_idle_cpus(tmp_path: Path) -> None:
    root = cgroup(tmp_path, {"cpu.max": "100000 100000\n"})
    assert choose_threads(3, {"OMP_NUM_THREADS": "2"}, root, idle=3).line() == (
        f"torch threads: 3 (training.threads=3); OpenMP threads {SPIN}"
    )
    assert choose_threads(0, {"OMP_NUM_THREADS": "2"}, root, idle=1).line() == (
        "torch threads: 2 (OMP_NUM_THREADS=2); OpenMP threads sleep while they wait (1 idle CPU(s) for 2 threads)"
    )
    assert choose_threads(1, {}, root, idle=0).waits == SPIN  # one thread waits for no other
    assert choose_threads(2, {}, root, idle=None).waits == SPIN  # not known: OpenMP's default
    assert choose_threads(2, {"OMP_WAIT_POLICY": "ACTIVE"}, root, idle=0).waits == "wait as OMP_WAIT_POLICY=ACTIVE says"
    assert choose_threads(2, {"OMP_WAIT_POLICY": "PASSIVE"}, root, idle=0).waits.startswith("sleep")
    late = choose_threads(2, {}, root, idle=0, torch_loaded=True)  # OpenMP read its policy already
    assert late.waits == f"{SPIN}: torch was loaded before OMP_WAIT_POLICY could be set"
    assert choose_threads(0, {}, root, idle=2).threads == 1  # the cgroup quota


def test_openmp_waits_passively_only_where_the_choice_says_so() -> None:
    environ: dict[str, str] = {}
    set_openmp_waits(ThreadChoice(2, "training.threads=2"), environ)
    assert environ == {}
    sleeping = ThreadChoice(2, "training.threads=2", "sleep while they wait (1 idle CPU(s) for 2 threads)")
    set_openmp_waits(sleeping, environ)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ["OMP_WAIT_POLICY"] = "ACTIVE"
    set_openmp_waits(sleeping, environ)
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    # the policy is read once, when torch loads: the command line must decide before anything imports torch
    check = "import sys, retrain.cli; assert 'torch' not in sys.modules, 'retrain.cli imports torch'"
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True)


def test_the_command_line_knows_training_threads_as_an_override() -> None:
    assert threads_override(["experiment=quickstart", "training.threads=2", "++training.threads=3"]) == 3
    assert threads_override(["experiment=quickstart", "-m", "training.threads=1,2"]) == 0  # a sweep: each job's own
    assert threads_override(["training.threads_x=2"]) == 0


def test_a_cpu_a_busy_loop_keeps_busy_is_not_idle() -> None:
    """The real /proc/stat, with a busy loop pinned to one of this process's CPUs."""
    cpu = min(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)  # started and pinned
        before = PROC_STAT.read_text()
        time.sleep(0.3)
        assert idle_cpu_count(before, PROC_STAT.read_text(), {cpu}) == 0
    finally:
        loop.kill()
        loop.wait()


def test_a_run_logs_its_thread_count_and_why(tmp_path: Path) -> None:
    # fails as the run builds its parts, after the threads are set (a missing data file is refused before that)
    fails_early = ["experiment=quickstart", "reward._target_=no_such_module.reward"]
    for extra, line in [
        ([], f"torch threads: 1 (OMP_NUM_THREADS=1); OpenMP threads {SPIN}"),
        (["training.threads=2"], "torch threads: 2 (training.threads=2); OpenMP threads "),
        # more threads than there can be idle CPUs: OMP_WAIT_POLICY was set before torch loaded
        ([f"training.threads={AFFINITY + 1}"], "OpenMP threads sleep while they wait"),
    ]:
        result = run_cli([*fails_early, *extra, f"hydra.run.dir={tmp_path / str(len(extra))}"], tmp_path, check=False)
        assert line in result.stdout, result.stdout
    auto = {k: v for k, v in cli_env().items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-m", "retrain", *fails_early, f"hydra.run.dir={tmp_path / 'auto'}"],
        cwd=tmp_path,
        env=auto,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "usable CPU(s), limited by CPU affinity, " in result.stdout, result.stdout
    assert "idle at the start; training.threads=N sets it); OpenMP threads " in result.stdout, result.stdout


def test_a_thread_setting_that_is_no_ascii_number_is_ignored_or_refused_naming_it(tmp_path: Path) -> None:
    """`²` passes str.isdigit but not int: the variables are ignored with a warning (as OpenMP ignores them),
    `training.threads=²` is refused naming the key, and neither is a traceback, `--cfg job` included."""
    bad = {"OMP_NUM_THREADS": "²", "SLURM_CPUS_PER_TASK": "²"}
    assert choose_threads(0, bad, tmp_path, idle=0).threads == AFFINITY
    assert usable_cpus(bad, tmp_path) == (AFFINITY, "CPU affinity")
    assert ignored_settings(bad) == [f"{name}='²' is not a whole number > 0: ignored" for name in bad]
    assert ignored_settings({"OMP_NUM_THREADS": " 4 ", "SLURM_CPUS_PER_TASK": ""}) == []
    assert threads_override(["training.threads=²"]) == 0
    env = {**cli_env(), **bad}
    shown = subprocess.run(
        [sys.executable, "-m", "retrain", "experiment=quickstart", "--cfg", "job"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0 and "threads: 0" in shown.stdout, shown.stderr
    refused = run_cli(["experiment=quickstart", "training.threads=²", "--cfg", "job"], tmp_path, check=False)
    assert refused.returncode == 1 and "training.threads" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    # fails once threads are set (a missing file would be refused before: start-up checks come first)
    fails_early = ["experiment=quickstart", "reward._target_=no_such_module.reward", f"hydra.run.dir={tmp_path}/r"]
    run = subprocess.run(
        [sys.executable, "-m", "retrain", *fails_early], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert "OMP_NUM_THREADS='²' is not a whole number > 0: ignored" in run.stdout + run.stderr, run.stdout + run.stderr
    assert "usable CPU(s), limited by CPU affinity" in run.stdout


@pytest.mark.parametrize(("launcher", "cpus"), [("local", 1), ("slurm", None), (None, None)])
def test_a_local_sweep_job_gets_its_launchers_cpus_per_task(launcher: str | None, cpus: int | None) -> None:
    """hydra/launcher=local runs a sweep's jobs side by side on this machine: each gets `cpus_per_task`."""
    config = compose([f"hydra/launcher={launcher}"] if launcher else [], return_hydra_config=True)
    HydraConfig.instance().set_config(config)
    try:
        assert local_sweep_job_cpus() == cpus
    finally:
        HydraConfig.instance().cfg = None


def test_torch_keeps_its_thread_pool_when_it_already_has_the_chosen_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.set_num_threads, even with the count torch has, turns MKL's dynamic threading off for good, and
    MKL's small matrix products inside torch's parallel ops then compete for the cores (CPU attention ~4× slower,
    docs/benchmarks.md): the run calls it only to change the count."""
    import torch

    from retrain.run import use_usable_cpus

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    current = torch.get_num_threads()
    use_usable_cpus(current)
    assert calls == []
    use_usable_cpus(current + 1)
    assert calls == [current + 1]
