"""Launching into a run dir: a refused launch leaves the dir as it was, a plugin that does not import says
why, and SIGTERM or Ctrl-C stop a run after its step with a checkpoint."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from retrain.campaign.preemption import requeue_on_preemption
from retrain.cli import FailedJob
from retrain.commands.status import main as status_main
from retrain.config import compose
from retrain.error_lines import user_error_behind
from retrain.errors import ConfigError
from retrain.housekeeping.launch import RunDirRefused, claimed_run_dir
from retrain.housekeeping.rundir import RunDir
from retrain.run import target_class
from tests.conftest import CliHere, cli_env, read_metrics, run_cli

SMALL = [
    "experiment=quickstart",
    "eval.num_examples=0",
    "logging.progress_bar=false",
    "scoring.workers=1",
    "training.batch_size=2",
    "training.group_size=2",
]
UNIMPORTABLE = "tests.plugins.unimportable_plugin"
MISSING_DEPENDENCY = "No module named 'retrain_tests_dependency_not_installed'"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir as a one-step run leaves it (tests copy it before changing it)."""
    root = tmp_path_factory.mktemp("trained")
    run_cli([*SMALL, "training.max_steps=1", f"hydra.run.dir={root / 'run'}"], cwd=root)
    return root / "run"


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "sweep" / "job"
    shutil.copytree(run_dir, copy)
    return copy


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its bytes (None for a dir)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def relaunch(cli: CliHere, run_dir: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess[str]:
    """The same command again into `run_dir`: directly, or as the one job of a sweep that resolves to it."""
    where = (
        ["--multirun", f"hydra.sweep.dir={run_dir.parent}", f"hydra.sweep.subdir={run_dir.name}"]
        if multirun
        else [f"hydra.run.dir={run_dir}"]
    )
    return cli([*where, *SMALL, "training.max_steps=1", *overrides], run_dir.parent.parent, check=False)


@contextmanager
def held(run_dir: Path) -> Iterator[None]:
    """Hold the run dir's lock as the process training there does."""
    with open(RunDir(run_dir).lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield


def test_a_launch_into_a_run_dir_in_use_leaves_it_byte_for_byte_untouched(
    trained: Path, tmp_path: Path, cli_here: CliHere
) -> None:
    run_dir = copy_of(trained, tmp_path)
    before = snapshot(run_dir)
    with held(run_dir):
        single = relaunch(cli_here, run_dir)
        sweep = relaunch(cli_here, run_dir, multirun=True)
    assert single.returncode == 1 and "is in use by another retrain process" in single.stdout, single.stdout
    assert "Traceback" not in single.stdout + single.stderr
    assert sweep.returncode != 0 and "is in use by another retrain process" in sweep.stderr, sweep.stderr
    # Hydra's .hydra/*.yaml, the campaign's job.json and exit.json, run.log: all as the live run left them
    assert snapshot(run_dir) == before


def test_a_run_dir_whose_run_has_no_checkpoint_yet_refuses_another_config(
    trained: Path, tmp_path: Path, cli_here: CliHere
) -> None:
    run_dir = copy_of(trained, tmp_path)
    for checkpoint in (run_dir / "final", run_dir / "checkpoints"):  # killed before its first checkpoint
        shutil.rmtree(checkpoint, ignore_errors=True)
    before = snapshot(run_dir)
    single = relaunch(cli_here, run_dir, "training.lr=0.5")
    sweep = relaunch(cli_here, run_dir, "training.lr=0.5", multirun=True)
    for result, console in ((single, single.stdout), (sweep, sweep.stderr)):
        assert result.returncode != 0 and "holds a run with a different config" in console, console
        assert "training.lr: 0.001 -> 0.5" in console
    assert snapshot(run_dir) == before  # no exit.json from the refused sweep job, not a line in run.log
    assert len(read_metrics(run_dir)) == 1


def test_the_identity_recorded_at_start_decides_who_may_continue(tmp_path: Path) -> None:
    first, other = {"training.lr": 0.001}, {"training.lr": 0.5}
    files = RunDir(tmp_path)
    with claimed_run_dir(tmp_path, first):
        pass
    assert json.loads(files.identity_file.read_text()) == first
    with claimed_run_dir(tmp_path, other):  # it never trained (it failed at start): a new config takes it over
        pass
    files.metrics.write_text('{"step": 0}\n')
    with claimed_run_dir(tmp_path, other):  # the same run continues
        pass
    with pytest.raises(RunDirRefused, match="different config"), claimed_run_dir(tmp_path, first):
        pass
    assert json.loads(files.identity_file.read_text()) == other
    with held(tmp_path), pytest.raises(RunDirRefused, match="in use"), claimed_run_dir(tmp_path, other):
        pass


def test_a_plugin_whose_import_fails_names_the_import_error(tmp_path: Path, cli_here: CliHere) -> None:
    with pytest.raises(InstantiationException) as located:
        instantiate(OmegaConf.create({"reward": {"_target_": f"{UNIMPORTABLE}.reward"}}).reward)
    assert "Error locating target" in str(located.value)  # all that Hydra says
    message = str(user_error_behind(located.value))
    assert f"reward._target_='{UNIMPORTABLE}.reward' cannot be imported: importing {UNIMPORTABLE} raised" in message
    assert MISSING_DEPENDENCY in message and "unimportable_plugin.py, line 5" in message

    with pytest.raises(ConfigError, match=f"backend._target_='{UNIMPORTABLE}.Backend' cannot be imported") as backend:
        target_class(compose([f"backend._target_={UNIMPORTABLE}.Backend"]), "backend")
    assert MISSING_DEPENDENCY in str(backend.value)

    # a --multirun job's error is printed by Hydra itself: the real import error, not "Error locating target"
    sweep = cli_here(
        ["--multirun", *SMALL, f"reward._target_={UNIMPORTABLE}.reward", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        tmp_path,
        check=False,
    )
    assert sweep.returncode != 0 and MISSING_DEPENDENCY in sweep.stderr, sweep.stderr
    assert f"importing {UNIMPORTABLE} raised ModuleNotFoundError" in sweep.stderr
    assert "retrain: job #0 (" in sweep.stderr and "Traceback" not in sweep.stderr, sweep.stderr


class Run:
    """What the signal guard needs of a trainer; `step` is where the signal arrives."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.stop_requests = 0

    def request_stop(self) -> None:
        self.stop_requests += 1

    def step(self, *signals: signal.Signals) -> None:
        for number in signals:
            os.kill(os.getpid(), number)
        (self.run_dir / "status.json").write_text(json.dumps({"state": "stopped"}))


@pytest.fixture
def outside_a_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """No submitit job; SIGTERM and SIGINT recorded rather than ending pytest, unless the guard takes them over."""
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    unguarded: list[int] = []

    def record(number: int, frame: Any) -> None:
        unguarded.append(number)

    previous = {number: signal.signal(number, record) for number in (signal.SIGTERM, signal.SIGINT)}
    yield unguarded
    for number, handler in previous.items():
        signal.signal(number, handler)


@pytest.mark.parametrize(("sent", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_ctrl_c_outside_a_cluster_stops_after_the_step(
    tmp_path: Path, outside_a_cluster: list[int], sent: signal.Signals, code: int
) -> None:
    run = Run(tmp_path)
    with pytest.raises(SystemExit) as exited, requeue_on_preemption(run):
        run.step(sent)
    assert outside_a_cluster == [] and run.stop_requests == 1 and exited.value.code == code
    assert signal.getsignal(sent).__name__ == "record"  # handlers restored

    impatient = Run(tmp_path)
    with pytest.raises(KeyboardInterrupt), requeue_on_preemption(impatient):
        impatient.step(signal.SIGINT, signal.SIGINT)  # Ctrl-C twice: at once, no checkpoint


def test_sigterm_checkpoints_after_the_step_and_records_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    args = [*SMALL, "training.max_steps=200", "training.save_every=0", f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "retrain", *args], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and not (run_dir / "metrics.jsonl").is_file():
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 143, output
    status = json.loads((run_dir / "status.json").read_text())
    done = len(read_metrics(run_dir))
    assert status["state"] == "stopped" and status["step"] == done - 1 < 199
    assert (run_dir / "checkpoints" / f"step_{done}" / "trainer_state.json").is_file()  # save_every=0: the stop's own
    assert "Received SIGTERM: stopping after this step to checkpoint." in output
    assert status_main([str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "stopped"  # resumable, not a dead run

    # the exact command that resumes it: the same overrides, into the same dir (the default one is time-stamped)
    command = output.split("Resume with:\n  ")[1].splitlines()[0]
    typed = [arg for arg in args if not arg.startswith("hydra.run.dir=")]
    assert command == shlex.join(["python", "-m", "retrain", *typed, f"hydra.run.dir={run_dir.resolve()}"])
    one_more = [*shlex.split(command)[3:], f"training.max_steps={done + 1}", "eval.num_examples=2"]
    resumed = run_cli(one_more, cwd=tmp_path).stdout
    assert len(read_metrics(run_dir)) == done + 1  # it continued: one step more, none repeated
    assert resumed.startswith(f"run dir: {run_dir.resolve()} ")
    last = resumed.strip().splitlines()[-1]
    assert last.startswith(f"done: {done + 1} steps in {run_dir.resolve()}; held-out accuracy greedy "), last
    assert last.endswith(f"adapter: {run_dir.resolve() / 'final'}")


def test_a_failed_jobs_user_error_survives_the_trip_back_from_a_cluster_node() -> None:
    refused = RunDirRefused("run dir x holds a run with a different config")
    failed = pickle.loads(pickle.dumps(FailedJob("retrain: job #3 (x) failed: ...", refused)))
    assert str(failed) == "retrain: job #3 (x) failed: ..." and isinstance(failed.user_error, RunDirRefused)
    assert str(failed.user_error) == str(refused)  # what the campaign records of the job (callbacks.on_job_end)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["data=jsonl", "data.path=broken.jsonl"], "data.path='broken.jsonl': cannot read the records"),
        ([f"reward._target_={UNIMPORTABLE}.reward"], f"reward._target_='{UNIMPORTABLE}.reward' cannot be imported"),
        (["data=jsonl", "data.path=one_file.jsonl", "eval.num_examples=5"], "has no held-out split"),
    ],
)
def test_a_run_that_fails_while_being_built_records_failed_with_its_error(
    tmp_path: Path, cli_here: CliHere, overrides: list[str], error: str
) -> None:
    (tmp_path / "one_file.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (tmp_path / "broken.jsonl").write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": \n')
    run_dir = tmp_path / "run"
    result = cli_here([*SMALL, *overrides, f"hydra.run.dir={run_dir}"], tmp_path, check=False)
    assert result.returncode == 1 and error in result.stdout, result.stdout
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and error in status["error"] and "\n" not in status["error"]
    shown = json.loads(cli_here(["status", str(run_dir), "--json"], tmp_path).stdout)
    assert shown["state"] == "failed" and error in shown["error"]  # not `dead ... updated never`
