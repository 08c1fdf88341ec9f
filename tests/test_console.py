"""What a real run prints: the progress bar only on a terminal (a log file gets the step lines alone, one per
line), and the KL to the base model on the step line when the loss has one."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from retrain.commands.explain import composed
from retrain.config_checks.validation import config_problems
from tests.conftest import cli_env, run_cli

TINY = ["experiment=quickstart", "training.max_steps=2", "eval.num_examples=0", "training.save_every=0"]


def step_lines(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if line.lstrip("\r").startswith("Step ")]


def test_into_a_pipe_the_console_has_no_bar_and_shows_the_kl(tmp_path: Path) -> None:
    printed = run_cli([*TINY, "training.kl_coef=0.01", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    output = printed.stdout + printed.stderr
    assert "\r" not in output  # no bar redraws: nohup's and SLURM's logs keep one step a line
    lines = step_lines(output)
    assert [line.split(" [")[0] for line in lines] == ["Step 0", "Step 1"]
    assert all(" | loss=" in line and " | kl=" in line for line in lines)
    without = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'no_kl'}"], cwd=tmp_path)
    assert step_lines(without.stdout) and not any("kl=" in line for line in step_lines(without.stdout))


def on_a_terminal(args: list[str], cwd: Path) -> str:
    """What `python -m retrain ARGS` prints with a terminal (a pty) as its stdout and stderr."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    process = subprocess.Popen(
        [sys.executable, "-m", "retrain", *args], cwd=cwd, env=cli_env(), stdout=terminal, stderr=terminal
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the child closed the terminal (EIO on Linux)
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert process.wait(timeout=600) == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize(("setting", "drawn"), [("auto", True), ("false", False)])
def test_on_a_terminal_the_bar_is_drawn_unless_turned_off(tmp_path: Path, setting: str, drawn: bool) -> None:
    printed = on_a_terminal([*TINY, f"logging.progress_bar={setting}", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert ("2/2 [" in printed) is drawn  # tqdm's `n/total [elapsed<remaining, rate]`
    assert len(step_lines(printed)) == 2


def test_the_bar_setting_is_checked_at_compose_time() -> None:
    assert not config_problems(composed(["logging.progress_bar=true"]))
    assert config_problems(composed(["logging.progress_bar=sometimes"])) == [
        "logging.progress_bar must be auto, true or false, got sometimes"
    ]
