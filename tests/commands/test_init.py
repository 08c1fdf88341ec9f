"""`retrain init`: a preset written into the user's config dir composes and runs as printed."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from retrain.assets import TINY_MODEL_DIR
from retrain.commands.explain import composed
from retrain.commands.init import PRESETS, main
from tests.conftest import cli_env, run_cli


def init(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.chdir(tmp_path)
    return main(list(args))


def test_list_names_every_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"conf/{preset.group}/<name>.yaml" in out for preset in PRESETS.values())
    assert [line.split()[0] for line in out.splitlines() if not line.startswith(" ")] == list(PRESETS)


def test_quickstart_is_the_demo_under_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert init(tmp_path, monkeypatch, "--template", "quickstart", "--name", "demo") == 0
    assert "python -m retrain --config-dir conf experiment=demo" in capsys.readouterr().out
    written = (tmp_path / "conf" / "experiment" / "demo.yaml").read_text()
    assert written.startswith("# @package _global_\n# demo:")
    builtin = run_cli(["experiment=quickstart", "--cfg", "job"], cwd=tmp_path).stdout
    assert run_cli(["--config-dir", "conf", "experiment=demo", "--cfg", "job"], cwd=tmp_path).stdout == builtin


def test_experiment_composes_with_its_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert init(tmp_path, monkeypatch, "--template", "experiment") == 0
    composed = run_cli(["--config-dir", "conf", "experiment=my_experiment", "--cfg", "job"], cwd=tmp_path).stdout
    cfg = yaml.safe_load(composed)
    assert cfg["training"]["seed"] == 42 and cfg["training"]["max_tokens"] == 4096
    assert cfg["reward"]["_target_"] == "retrain.reward.math.MathReward"
    assert cfg["algorithm"]["transforms"]["sepa"]["_target_"] == "retrain.algorithm.transforms.SEPAPooling"


def test_campaign_sweeps_its_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert init(tmp_path, monkeypatch, "--template", "campaign", "--name", "grid") == 0
    assert (tmp_path / "conf" / "campaign" / "grid.yaml").is_file()
    args = ["--config-dir", "conf", "+campaign=grid", "experiment=quickstart"]
    hydra_cfg = yaml.safe_load(run_cli([*args, "--cfg", "hydra"], cwd=tmp_path).stdout)["hydra"]
    assert hydra_cfg["sweeper"]["params"] == {
        "algorithm": "grpo_none,maxrl_none,maxrl_gtpo_sepa",
        "training.seed": "1,2,3",
    }
    assert hydra_cfg["callbacks"]["campaign"]["baseline"] == "grpo_none"
    job = yaml.safe_load(run_cli([*args, "--cfg", "job", "--resolve"], cwd=tmp_path).stdout)
    assert job["logging"]["wandb_group"] == "maxrl_gtpo_sepa" and job["logging"]["wandb_tags"][1] == "seed0"


def test_refuses_to_overwrite_without_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert init(tmp_path, monkeypatch, "--template", "experiment", "--name", "mine") == 0
    preset = tmp_path / "conf" / "experiment" / "mine.yaml"
    preset.write_text("# edited\n")
    with pytest.raises(SystemExit) as refused:
        init(tmp_path, monkeypatch, "--template", "experiment", "--name", "mine")
    assert refused.value.code == 1 and "--force" in capsys.readouterr().err
    assert preset.read_text() == "# edited\n"
    assert init(tmp_path, monkeypatch, "--template", "experiment", "--name", "mine", "--force") == 0
    assert preset.read_text() != "# edited\n"


def test_refuses_a_name_a_builtin_preset_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        init(tmp_path, monkeypatch, "--template", "quickstart", "--name", "quickstart")
    assert refused.value.code == 1 and "experiment=quickstart is a built-in preset" in capsys.readouterr().err
    assert not (tmp_path / "conf").exists()


def test_a_config_dir_that_is_a_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "old.toml").write_text("[training]\n")
    with pytest.raises(SystemExit) as refused:
        init(tmp_path, monkeypatch, "--template", "quickstart", "--config-dir", "old.toml")
    error = capsys.readouterr().err
    assert refused.value.code == 1 and "Traceback" not in error
    assert "retrain init: cannot write old.toml/experiment/my_quickstart.yaml: Not a directory" in error


@pytest.mark.slow
def test_the_written_quickstart_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert init(tmp_path, monkeypatch, "--template", "quickstart") == 0
    run_dir = tmp_path / "run"
    overrides = [
        "training.max_steps=2",
        "eval.num_examples=0",
        "logging.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    run_cli(["--config-dir", "conf", "experiment=my_quickstart", *overrides], cwd=tmp_path)
    assert (run_dir / "final" / "adapter_model.safetensors").is_file()


def answered(*lines: str) -> str:
    return "".join(f"{line}\n" for line in lines)


def test_interactive_takes_every_answer_from_piped_stdin(tmp_path: Path) -> None:
    """No terminal: the answers come a line each on stdin, as from a script; the preset runs as answered."""
    answers = answered("tiny", "arithmetic", "match", "grpo_none", "local", "cpu", "pytorch", "3", "")
    result = subprocess.run(
        [sys.executable, "-m", "retrain", "init", "--interactive", "--name", "first"],
        input=answers,
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "data (agent, arithmetic, gsm8k, jsonl, math, verifiers) [math]: arithmetic" in result.stdout
    )  # defaults shown
    assert "training.max_tokens (new tokens per completion) [64]: \n" in result.stdout  # half the tiny model's 128
    assert result.stdout.endswith("run it with:\n  python -m retrain --config-dir conf experiment=first\n")
    cfg = composed(["experiment=first"], tmp_path / "conf")  # as `python -m retrain --config-dir conf` composes it
    assert cfg.model.name_or_path == "retrain:tiny_qwen3" and cfg.backend.devices == "cpu"
    assert cfg.data._target_ == "retrain.data.arithmetic.ArithmeticData"
    assert cfg.reward._target_ == "retrain.reward.match.match_reward"
    assert cfg.algorithm.transforms == {} and cfg.inference._target_.endswith("PytorchEngine")
    assert cfg.training.max_steps == 3 and cfg.training.max_tokens == 64


def interactive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: str, *args: str) -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(answers))  # a pipe: no terminal to ask again
    return init(tmp_path, monkeypatch, "--interactive", *args)


def test_interactive_empty_answers_take_the_shown_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert interactive(tmp_path, monkeypatch, answered(*[""] * 9)) == 0
    out = capsys.readouterr().out
    assert "model: an option, a Hub id or a local directory (qwen3_4b_instruct, tiny) [qwen3_4b_instruct]" in out
    cfg = composed(["experiment=my_run"], tmp_path / "conf")
    default = composed([])
    for group in ("model", "data", "reward", "algorithm", "backend", "inference"):
        assert cfg.hydra.runtime.choices[group] == default.hydra.runtime.choices[group]
    assert cfg.training.max_steps == default.training.max_steps  # a Hub model's context is not fetched to cap it
    assert cfg.training.max_tokens == default.training.max_tokens
    assert cfg.backend.devices == ("gpu:0" if torch.cuda.is_available() else "cpu")  # the first run runs here


def test_interactive_takes_a_model_that_is_no_option_as_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = answered(str(TINY_MODEL_DIR), "arithmetic", "match", "", "local", "cpu", "pytorch", "2", "")
    assert interactive(tmp_path, monkeypatch, answers, "--name", "own") == 0
    cfg = composed(["experiment=own"], tmp_path / "conf")
    assert cfg.model.name_or_path == str(TINY_MODEL_DIR) and cfg.training.max_tokens == 64  # its context, read here


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        (
            answered("tiny", "arithmetc"),
            "data: 'arithmetc' is not one of: agent, arithmetic, gsm8k, jsonl, math, verifiers",
        ),
        (answered("tiny", "arithmetic", "match", "", "local", "cpu", "", "zero"), "'zero' is not a whole number"),
        (
            answered("tiny", "jsonl", ""),
            "data.path: a jsonl/parquet/csv file, directory or Hub id: an answer is needed",
        ),
        (answered("tiny"), "stdin ended before 'data' was answered"),
        (answered("tiny", "arithmetic", "match", "", "local", "cpu", "", "²"), "'²' is not a whole number >= 1"),
        (answered("/nowhere/model"), "model.name_or_path='/nowhere/model': no such file or directory"),
        (answered("ti\0ny"), "'ti\\x00ny' holds the control character '\\x00'; type it without"),
        (
            answered("tiny", "jsonl", "a\0b"),
            "data.path: a jsonl/parquet/csv file, directory or Hub id: 'a\\x00b' holds",
        ),
    ],
)
def test_interactive_refuses_an_answer_it_cannot_use_naming_the_question(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], answers: str, message: str
) -> None:
    with pytest.raises(SystemExit) as refused:
        interactive(tmp_path, monkeypatch, answers)
    err = capsys.readouterr().err
    assert refused.value.code == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "conf" / "experiment" / "my_run.yaml").exists()


def test_interactive_asks_again_on_a_terminal(tmp_path: Path) -> None:
    """A person at a terminal is told what is wrong with an answer and asked again (a pseudo-terminal here)."""
    answers = ["/nowhere/model", "ti\0ny", "tiny", "arithmetic", "match", "", "local", "cpu", "pytorch", "²", "2", ""]
    leader, follower = pty.openpty()
    with os.fdopen(leader, "w", closefd=False) as typed:
        typed.write("".join(f"{answer}\n" for answer in answers))
    result = subprocess.run(
        [sys.executable, "-m", "retrain", "init", "--interactive"],
        stdin=follower,
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    os.close(follower)
    os.close(leader)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model.name_or_path='/nowhere/model': no such file or directory" in result.stdout
    assert "holds the control character" in result.stdout and "'²' is not a whole number >= 1" in result.stdout
    assert composed(["experiment=my_run"], tmp_path / "conf").training.max_steps == 2
