"""`retrain init`: a preset written into the user's config dir composes and runs as printed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from retrain.commands.init import PRESETS, main
from tests.conftest import run_cli


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
