"""`retrain status` on run dirs, sweep dirs and folders of them, while running and after."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retrain.campaign.manifest import CampaignSettings, start_manifest
from retrain.campaign.plan import expand
from retrain.commands.status import main
from tests.campaign.rundirs import dead_pid, simulate_run
from tests.conftest import QUICK, cli_env, read_metrics


def test_a_live_run_is_running_and_a_vanished_one_dead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live = simulate_run(tmp_path, "grpo_none", 1, 0.5, state="running", pid=os.getpid())
    assert main([str(live.dir)]) == 0
    text = capsys.readouterr().out
    assert "state: running" in text and "condition: grpo_none  seed: 1" in text
    assert f"last step {live.draws[-1].mean():.3f}" in text

    gone = simulate_run(tmp_path, "grpo_none", 2, 0.5, state="running", pid=dead_pid())
    assert main([str(gone.dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "dead" and report["seed"] == 2


def test_sweep_status_prints_the_summary_and_can_rewrite_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep_dir = tmp_path / "sweep"
    plan = expand(["algorithm=grpo_none,maxrl_gtpo_sepa", "training.seed=1,2"])
    start_manifest(sweep_dir, plan, CampaignSettings(last_k=3), "BasicLauncher", None)
    for job in plan[:3]:
        simulate_run(sweep_dir, job.condition, job.seed, 0.4, num=job.num)
    # the fourth run is still training in a live process
    simulate_run(sweep_dir, "maxrl_gtpo_sepa", 2, 0.4, state="running", num=3, pid=os.getpid())
    assert main([str(sweep_dir)]) == 0
    text = capsys.readouterr().out
    assert "state: **running** (3 done, 1 running)" in text
    assert "`maxrl_gtpo_sepa_s2` | running" in text
    assert not (sweep_dir / "summary.md").exists()  # read-only unless --write

    assert main([str(sweep_dir), "--write", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["state"] == "running" and (sweep_dir / "summary.md").is_file()
    assert {row["condition"]: row["done"] for row in summary["conditions"]} == {"grpo_none": 2, "maxrl_gtpo_sepa": 1}


def test_sweep_status_shows_held_out_accuracy_per_condition(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = expand(["algorithm=grpo_none,maxrl_gtpo_sepa", "training.seed=1,2"])
    start_manifest(tmp_path, plan, CampaignSettings(last_k=3), "BasicLauncher", None)
    runs = [
        simulate_run(tmp_path, job.condition or "", job.seed or 0, 0.4, num=job.num, held_out=(0.2, 0.5), eval_every=5)
        for job in plan
    ]
    assert main([str(tmp_path), "--json"]) == 0
    rows = {row["condition"]: row for row in json.loads(capsys.readouterr().out)["conditions"]}
    after = [run.eval["eval/after_greedy_accuracy"] for run in runs if run.condition == "grpo_none"]
    assert rows["grpo_none"]["held_out"]["greedy"]["after"]["mean"] == pytest.approx(sum(after) / 2)
    assert [p["step"] for p in rows["grpo_none"]["held_out"]["sampled"]["points"]] == sorted(runs[0].eval_points)
    assert main([str(tmp_path), "--write"]) == 0
    text = capsys.readouterr().out
    assert "## Held-out accuracy" in text and "| `maxrl_gtpo_sepa` | sampled |" in text
    assert "![held-out accuracy](held_out_accuracy.png)" in text


def test_folder_overview_and_bad_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep_dir = tmp_path / "sweeps" / "a"
    start_manifest(
        sweep_dir, expand(["algorithm=grpo_none", "training.seed=1"]), CampaignSettings(), "BasicLauncher", None
    )
    simulate_run(sweep_dir, "grpo_none", 1, 0.4, num=0)
    simulate_run(tmp_path / "runs", "maxrl_none", 5, 0.4, state="failed", error="ValueError: bad")
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("sweep  done") and line.rstrip().endswith("(1 done)") for line in lines)
    assert any(line.startswith("run    failed") and "maxrl_none_s5" in line for line in lines)

    assert main([str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 1


def test_the_cli_dispatches_status(tmp_path: Path) -> None:
    run = simulate_run(tmp_path, "grpo_none", 3, 0.5)
    result = subprocess.run(
        [sys.executable, "-m", "retrain", "status", str(run.dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert result.returncode == 0, result.stderr
    assert "state: done" in result.stdout


def test_a_run_that_never_wrote_status_takes_its_condition_from_the_saved_config(tmp_path: Path) -> None:
    """Hydra saves `algorithm.name` unresolved (it is derived from the parts): it is resolved on reading."""
    from omegaconf import OmegaConf

    from retrain.campaign.runs import read_run
    from retrain.config import compose

    run_dir = tmp_path / "rloo_gtpo_s3"
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose(["algorithm=maxrl_gtpo", "algorithm/advantage=rloo"]), run_dir / ".hydra" / "config.yaml")
    assert "${" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert read_run(run_dir).condition == "rloo_gtpo"


GARBAGE = {
    "list_status": {"status.json": b"[1, 2]"},
    "binary_status": {"status.json": b"\xff\xfe\x00 not utf-8"},
    "string_job": {"job.json": b'"a string"'},
    "wrong_types": {"status.json": b'{"state": 5, "step": "x"}'},
    "infinite_step": {"status.json": b'{"state": "done", "step": Infinity}'},
    "nan_max_steps": {"status.json": b'{"state": "done", "step": 1, "max_steps": NaN}'},
    "list_config": {".hydra/config.yaml": b"- 1\n- 2\n"},
    "list_slurm": {"job.json": b'{"pid": 1, "slurm": [1]}'},
}


def write_garbage(root: Path) -> None:
    for name, files in GARBAGE.items():
        for relative, content in files.items():
            (root / name / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / name / relative).write_bytes(content)
    (root / "dir_as_status" / "status.json").mkdir(parents=True)


def test_garbage_run_dirs_are_listed_as_unreadable_beside_the_good_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_garbage(tmp_path)
    simulate_run(tmp_path, "grpo_none", 1, 0.4)
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    unreadable = {Path(line.split()[2]).name: line for line in lines if line.startswith("run    unreadable")}
    assert set(unreadable) == {*GARBAGE, "dir_as_status"}
    assert "status.json holds a list, not an object" in unreadable["list_status"]
    assert "status.json does not read (UnicodeDecodeError" in unreadable["binary_status"]
    assert "IsADirectoryError" in unreadable["dir_as_status"]
    assert "status.json's step is inf, not a whole number" in unreadable["infinite_step"]
    assert any(line.startswith("run    done") and "grpo_none_s1" in line for line in lines)

    assert main([str(tmp_path / "list_config"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["state"] == "unreadable" and ".hydra/config.yaml holds a list" in report["error"]


def test_a_garbage_run_in_a_sweep_is_reported_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep_dir = tmp_path / "sweep"
    plan = expand(["algorithm=grpo_none", "training.seed=1,2"])
    start_manifest(sweep_dir, plan, CampaignSettings(last_k=3), "BasicLauncher", None)
    simulate_run(sweep_dir, "grpo_none", 1, 0.4, num=0)
    broken = simulate_run(sweep_dir, "grpo_none", 2, 0.4, num=1)
    (broken.dir / "status.json").write_text("[1, 2]")
    assert main([str(sweep_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["counts"] == {"done": 1, "unreadable": 1}
    assert [f["name"] for f in summary["failed"]] == ["grpo_none_s2"]
    assert "status.json holds a list" in summary["failed"][0]["error"]


def test_watch_refreshes_a_live_run_until_its_count_and_a_finished_one_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    live = simulate_run(tmp_path, "grpo_none", 1, 0.5, state="running", pid=os.getpid())
    assert main([str(live.dir), "--watch", "--interval", "0.01", "--count", "3"]) == 0
    frames = capsys.readouterr().out.split(f"retrain status {live.dir}  (")[1:]
    assert len(frames) == 3 and all("state: running" in frame for frame in frames)
    done = simulate_run(tmp_path, "grpo_none", 2, 0.5)
    assert main([str(done.dir), "--watch", "--interval", "0.01"]) == 0
    assert capsys.readouterr().out.count("state: done") == 1
    for interval in ("0", "-1", "nan", "inf", "-inf"):
        with pytest.raises(SystemExit) as refused:
            main([str(done.dir), "--watch", f"--interval={interval}"])
        assert refused.value.code == 2 and "--interval must be a number of seconds > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_watch_follows_a_real_run_to_its_end(tmp_path: Path) -> None:
    """A training process of its own; `retrain status --watch` started once its run dir reports, as a user would."""
    run_dir = tmp_path / "run"
    # 40 steps (several seconds): the watch, a second Python starting on a possibly busy machine, must attach while
    # the run still trains (8 steps could end before it read its first frame)
    args = ["experiment=quickstart", "training.max_steps=40", "eval.num_examples=0", "logging.progress_bar=false"]
    training = subprocess.Popen(
        [sys.executable, "-m", "retrain", *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "status.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        watched = subprocess.run(
            [sys.executable, "-m", "retrain", "status", str(run_dir), "--watch", "--interval", "0.2", "--count", "600"],
            capture_output=True,
            text=True,
            timeout=180,
            env=cli_env(),
        )
    finally:
        training.wait(timeout=180)
    assert watched.returncode == 0, watched.stderr
    frames = watched.stdout.split(f"retrain status {run_dir}  (")[1:]
    assert len(frames) >= 2 and "state: running" in frames[0]
    assert "state: done  (steps 40/40" in frames[-1] and all("state: done" not in frame for frame in frames[:-1])


def test_a_stopped_run_names_the_command_that_resumes_it(tmp_path: Path) -> None:
    """A real run stopped by SIGTERM after a step; the command its status prints continues it in its own dir."""
    run_dir = tmp_path / "run"
    # more steps than it can take before the signal lands, however fast the machine; the resume then stops one
    # step later (the printed command with a smaller max_steps typed after it)
    args = [*QUICK, "training.max_steps=200", "training.batch_size=2", "training.group_size=2"]
    training = subprocess.Popen(
        [sys.executable, "-m", "retrain", *args, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    training.send_signal(signal.SIGTERM)
    training.wait(timeout=180)
    status = subprocess.run(
        [sys.executable, "-m", "retrain", "status", str(run_dir)], capture_output=True, text=True, env=cli_env()
    )
    assert "state: stopped" in status.stdout, status.stdout + status.stderr
    command = shlex.join(["python", "-m", "retrain", *args, f"hydra.run.dir={run_dir}"])
    assert f"  resume: cd {tmp_path} && {command}" in status.stdout.splitlines(), status.stdout
    python_first = {**cli_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    one_more = f"training.max_steps={len(read_metrics(run_dir)) + 1}"
    resumed = subprocess.run(
        ["bash", "-c", f"{status.stdout.split('  resume: ')[1].splitlines()[0]} {one_more}"],
        capture_output=True,
        text=True,
        env=python_first,
        timeout=300,
    )
    assert resumed.returncode == 0 and "Resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    assert json.loads((run_dir / "status.json").read_text())["state"] == "done"
    report = subprocess.run(
        [sys.executable, "-m", "retrain", "status", str(run_dir), "--json"], capture_output=True, text=True
    )
    assert json.loads(report.stdout)["resume_command"] is None  # a finished run has nothing to resume


def test_a_dead_run_names_the_command_that_resumes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gone = simulate_run(tmp_path, "grpo_none", 2, 0.5, state="running", pid=dead_pid(), num=0)
    job = json.loads(gone.dir.joinpath("job.json").read_text())
    gone.dir.joinpath("job.json").write_text(json.dumps({**job, "overrides": ["experiment=mine", "a=b c"]}))
    assert main([str(gone.dir)]) == 0
    text = capsys.readouterr().out
    assert "state: dead" in text
    assert f"  resume: python -m retrain experiment=mine 'a=b c' hydra.run.dir={gone.dir}" in text.splitlines()
    # started from /home/me with `--config-dir conf` (a preset of `retrain init`): both are part of the command
    sources = [{"path": "/home/me/conf", "schema": "file", "provider": "command-line"}, {"provider": "main"}]
    runtime = {"cwd": "/home/me", "config_sources": sources}
    (gone.dir / ".hydra" / "hydra.yaml").write_text(json.dumps({"hydra": {"runtime": runtime}}))
    assert main([str(gone.dir)]) == 0
    resume = (
        f"cd /home/me && python -m retrain --config-dir /home/me/conf experiment=mine 'a=b c' hydra.run.dir={gone.dir}"
    )
    assert f"  resume: {resume}" in capsys.readouterr().out.splitlines()


@pytest.mark.parametrize(
    "last_line",
    [
        '{"step": 12, "correct_rate": NaN, "running_correct_rate": NaN, "batch_size": 4, "group_size": 4}',
        '{"step": 12, "correct_rate": Infinity, "running_correct_rate": -Infinity, "batch_size": 4}',
        '{"step": 12, "loss": 1.0, "step_time_s": "slow"}',
    ],
)
def test_a_step_without_a_finite_correct_rate_is_skipped_not_fatal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], last_line: str
) -> None:
    run = simulate_run(tmp_path, "grpo_none", 1, 0.4)
    with open(run.dir / "metrics.jsonl", "a") as handle:
        handle.write(last_line + "\n")
    assert main([str(run.dir)]) == 0
    text = capsys.readouterr().out
    assert f"correct rate: last step {run.draws[-1].mean():.3f}" in text and "running —" in text
    assert main([str(run.dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} in --json"))
    assert report["final_correct_rate"] == pytest.approx(run.draws[-1].mean())
    assert report["running_correct_rate"] is None and report["last_step_time_s"] is None


def test_a_manifest_that_is_a_list_is_one_line_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep_dir = tmp_path / "sweep"
    start_manifest(sweep_dir, expand(["algorithm=grpo_none"]), CampaignSettings(), "BasicLauncher", None)
    (sweep_dir / "manifest.json").write_text("[1, 2]")
    assert main([str(sweep_dir)]) == 1
    error = capsys.readouterr().err
    assert error.strip() == (
        f"retrain status: {sweep_dir.resolve()} is an unreadable sweep dir "
        "(ValueError: manifest.json holds a list, not an object)"
    )
    assert main([str(tmp_path)]) == 0
    assert "sweep  unreadable" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["status.json", "job.json", ".hydra/config.yaml"])
def test_a_fifo_in_place_of_a_run_file_is_unreadable_not_a_hang(tmp_path: Path, name: str) -> None:
    run = simulate_run(tmp_path, "grpo_none", 1, 0.4, num=0)
    (run.dir / name).unlink()
    os.mkfifo(run.dir / name)
    status = subprocess.run(
        [sys.executable, "-m", "retrain", "status", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,  # reading the FIFO would block forever
    )
    assert status.returncode == 0, status.stderr
    (entry,) = json.loads(status.stdout)
    assert entry["state"] == "unreadable" and "is not a regular file (a FIFO" in entry["error"]
