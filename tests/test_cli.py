"""The command line as a user meets it: help, the composed config, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_cli


def test_help_lists_every_group(tmp_path: Path) -> None:
    out = run_cli(["--help"], cwd=tmp_path).stdout
    for group in ["backend", "model", "algorithm", "inference", "reward", "data", "experiment"]:
        assert f"{group}:" in out, f"--help does not list group {group}"
    assert "maxrl_gtpo_sepa" in out and "quickstart" in out


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    out = run_cli(["--cfg", "job", "experiment=quickstart", "training.lr=0.002"], cwd=tmp_path).stdout
    assert "lr: 0.002" in out
    assert "_target_: retrain.data.arithmetic.ArithmeticData" in out


def test_compose_errors_name_the_offending_key_or_option(tmp_path: Path) -> None:
    unknown = run_cli(["training.lrr=1"], cwd=tmp_path, check=False)
    assert unknown.returncode != 0 and "lrr" in unknown.stderr
    wrong_type = run_cli(["training.batch_size=eight"], cwd=tmp_path, check=False)
    assert wrong_type.returncode != 0 and "training.batch_size" in wrong_type.stderr
    unknown_option = run_cli(["algorithm=no_such_algorithm"], cwd=tmp_path, check=False)
    assert unknown_option.returncode != 0 and "algorithm/no_such_algorithm" in unknown_option.stderr
    # nothing was trained: no run dir was created for a config that does not compose
    assert not (tmp_path / "outputs").exists()


def test_a_typo_added_with_plus_is_refused_before_anything_loads(tmp_path: Path) -> None:
    result = run_cli(["experiment=quickstart", "+training.lrr=1e-4", f"hydra.run.dir={tmp_path / 'run'}"],
                     cwd=tmp_path, check=False)
    assert result.returncode != 0
    assert "unknown config key 'training.lrr'" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_preflight_refuses_token_credit_on_a_backend_that_aggregates_it(tmp_path: Path) -> None:
    result = run_cli(["experiment=quickstart", "algorithm=maxrl_gtpo_sepa",
                      "backend._target_=tests.plugins.training_plugins.ScalarAdvantageBackend",
                      f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, check=False)
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "maxrl_gtpo_sepa" in message and "ScalarAdvantageBackend" in message
    assert "preflight should have stopped" not in message
