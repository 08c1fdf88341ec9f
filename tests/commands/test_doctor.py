"""`retrain doctor`: the real command on this machine, and its checks against real files and commands."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import stat
from importlib.metadata import distribution, version
from pathlib import Path

import pytest
import torch

from retrain.commands.doctor import (
    EXTRAS,
    config_findings,
    device_findings,
    diagnose,
    install_command,
    model_findings,
    slurm_report,
    wandb_report,
)
from retrain.commands.explain import composed
from tests.conftest import CliHere, run_cli

HAS_GPU = torch.cuda.is_available()
SECRET = "wandb-key-that-must-never-be-printed"


def test_doctor_reports_the_machine_and_blocks_the_default_run_without_a_gpu(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("# local secrets\nexport HF_TOKEN=hf_private_value\nOTHER=1\n")
    env = {"HF_HUB_OFFLINE": "1", "WANDB_API_KEY": SECRET}
    result = run_cli(["doctor", "--json"], cwd=tmp_path, env=env, check=False, timeout=300)
    assert SECRET not in result.stdout and "hf_private_value" not in result.stdout
    report = json.loads(result.stdout)
    assert report["python"]["version"] == platform.python_version()
    assert report["torch"]["installed"] and report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == HAS_GPU and len(report["torch"]["gpus"]) == torch.cuda.device_count()
    assert all(gpu["memory_gib"] > 0 for gpu in report["torch"]["gpus"])
    assert set(report["extras"]) == set(EXTRAS)
    for extra, info in report["extras"].items():
        if extra == "vllm" and not HAS_GPU:  # PyPI's vLLM is a CUDA build: a CPU machine builds its own
            assert info["install"].startswith("bash scripts/install-vllm-cpu.sh"), info["install"]
        else:
            assert info["install"] == f"pip install 'retrain[{extra}]'"
        for module in info["modules"].values():
            if module["installed"] and module["distribution"]:
                assert module["version"] == version(module["distribution"])
    assert report["extras"]["prime_rl"]["modules"].keys() == {"msgspec", "zmq"}
    assert report["wandb"]["logged_in"] and report["wandb"]["credentials"] == "WANDB_API_KEY"
    assert report["hub"]["offline"] is True and report["hub"]["reachable"] is None
    assert set(report["slurm"]["commands"]) >= {"sinfo", "sbatch"}
    assert isinstance(report["slurm"]["cluster"]["answering"], bool)
    assert report["env_file"]["path"] == str(tmp_path / ".env")
    assert report["env_file"]["variables"] == ["HF_TOKEN", "OTHER"]
    assert report["run"]["devices"] == "gpu:0" and report["run"]["backend"] == "retrain.backend.local.LocalBackend"
    gpu_findings = [f for f in report["findings"] if f["check"] == "gpu"]
    if HAS_GPU:
        assert gpu_findings == []
    else:
        [finding] = gpu_findings
        assert finding["severity"] == "blocking" and "no CUDA GPU is visible" in finding["message"]
        assert "backend.devices=cpu" in finding["fix"] and "experiment=quickstart" in finding["fix"]
        assert result.returncode == 1 and report["ok"] is False


def test_doctor_passes_a_run_of_a_users_config_dir_this_machine_can_do(tmp_path: Path, cli_here: CliHere) -> None:
    presets = tmp_path / "conf" / "experiment"
    presets.mkdir(parents=True)
    (presets / "cpu_demo.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny\n  - override /data: arithmetic\n"
        "backend:\n  devices: cpu\n"
    )
    result = cli_here(["doctor", "--config-dir", "conf", "experiment=cpu_demo"], cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "devices cpu, model retrain:tiny_qwen3" in result.stdout
    assert "Ready for this run." in result.stdout and "BLOCKING" not in result.stdout


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_doctor_says_how_to_run_without_a_gpu(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(["doctor", "experiment=quickstart", "backend.devices=gpu:0"], cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert "BLOCKING: backend.devices='gpu:0' but no CUDA GPU is visible" in result.stdout
    assert "fix: backend.devices=cpu" in result.stdout
    assert "experiment=quickstart for the CPU demo" not in result.stdout  # it already is the demo


def test_doctor_names_a_config_typo_in_one_line() -> None:
    report: dict[str, object] = {}
    [finding] = config_findings(["experiment=quickstart", "trainig.lr=1"], None, report)
    assert finding.severity == "blocking" and finding.message.startswith(
        "the config does not compose: unknown config key 'trainig'; did you mean 'training'? (known: algorithm,"
    )
    assert report["run"] == {
        "overrides": ["experiment=quickstart", "trainig.lr=1"],
        "error": finding.message.removeprefix("the config does not compose: "),
    }


def test_doctor_suggests_the_demo_only_to_a_run_that_is_not_it(tmp_path: Path) -> None:
    no_gpu = {"installed": True, "gpus": [], "version": torch.__version__}
    hub_offline = {"offline": True, "reachable": None, "endpoint": "https://huggingface.co", "cache_dir": str(tmp_path)}
    hub_model = ["model.name_or_path=someone/not-cached", "backend.devices=gpu:0"]
    for overrides, suggested in [(hub_model, True), (["experiment=quickstart", *hub_model], False)]:
        cfg = composed(overrides)
        [gpu] = device_findings(cfg, no_gpu)
        [hub] = model_findings(cfg, hub_offline)
        assert ("experiment=quickstart" in gpu.fix) is suggested and ("experiment=quickstart" in hub.fix) is suggested
    assert hub.fix.endswith(", or set model.name_or_path=<a local model dir>")


def test_doctor_names_a_download_command_the_hub_installs(tmp_path: Path) -> None:
    """huggingface-hub 1.x installs `hf`, not `huggingface-cli`: the fix for a missing model must name a command
    the installed hub library provides."""
    hub_offline = {"offline": True, "reachable": None, "endpoint": "https://huggingface.co", "cache_dir": str(tmp_path)}
    [hub] = model_findings(composed(["model.name_or_path=someone/not-cached", "backend.devices=gpu:0"]), hub_offline)
    command = re.search(r"\((\S+) download someone/not-cached\)", hub.fix)
    assert command is not None, hub.fix
    scripts = {e.name for e in distribution("huggingface_hub").entry_points if e.group == "console_scripts"}
    assert command.group(1) in scripts


def fake_sinfo(directory: Path, script: str) -> None:
    sinfo = directory / "sinfo"
    sinfo.write_text(f"#!/bin/sh\n{script}\n")
    sinfo.chmod(sinfo.stat().st_mode | stat.S_IEXEC)


def test_slurm_is_found_answering_or_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fake_sinfo(tmp_path, "echo 'debug* up 2 idle'; echo 'gpu up 4 mix'")
    report = slurm_report()
    assert report["commands"]["sinfo"] == str(tmp_path / "sinfo")
    assert report["cluster"]["answering"] is True
    assert report["cluster"]["partitions"][1] == {
        "partition": "gpu",
        "availability": "up",
        "nodes": "4",
        "state": "mix",
    }
    fake_sinfo(tmp_path, "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; exit 1")
    assert "Unable to contact slurm controller" in slurm_report()["cluster"]["error"]
    # the quickstart on SLURM with no cluster answering is blocked; the quickstart itself is not
    blocked = diagnose(["experiment=quickstart", "hydra/launcher=slurm"])
    assert [f["check"] for f in blocked["findings"]] == ["slurm"] and blocked["ok"] is False
    assert diagnose(["experiment=quickstart"])["ok"] is True


def test_wandb_login_is_read_from_netrc_without_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_report({})["logged_in"] is False
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SECRET}\n")
    (tmp_path / "netrc").chmod(0o600)
    report = wandb_report({})
    assert report["logged_in"] is True and report["credentials"] == str(tmp_path / "netrc")
    assert SECRET not in json.dumps(report)


def test_doctor_reports_the_backends_capability_flags_and_their_source(tmp_path: Path, cli_here: CliHere) -> None:
    """The same flags and source as `retrain backends` and the trainer's startup line, text and --json."""
    from retrain.backend.capabilities import describe_backend

    hooks = "tests.plugins.backend_hooks"
    plugin = ["experiment=quickstart", f"backend._target_={hooks}.ClassHookedBackend"]
    report = json.loads(cli_here(["doctor", "--json", *plugin], cwd=tmp_path, check=False).stdout)
    expected = describe_backend(f"{hooks}.ClassHookedBackend").capabilities.as_dict()
    assert expected["resume_runtime_dependent"] and not expected["reports_sync_loss"]  # the hook's, not the defaults
    assert report["run"]["capabilities"] == {"flags": expected, "source": "plugin/hook", "error": None}
    text = cli_here(["doctor", "experiment=quickstart"], cwd=tmp_path).stdout
    assert (
        "backend capabilities (source=builtin): reports_sync_loss=True, preserves_token_advantages=True, "
        "supports_checkpoint_resume=True, resume_runtime_dependent=False, returns_entropies=True, samples_itself=False"
    ) in text
    module = cli_here(["doctor", "experiment=quickstart", f"backend._target_={hooks}.ModuleHookedBackend"], tmp_path)
    assert "backend capabilities (source=plugin/hook): reports_sync_loss=True" in module.stdout


@pytest.mark.parametrize(("cuda", "command"), [(False, "bash scripts/install-vllm-cpu.sh"), (True, "pip install")])
def test_vllm_is_installed_the_way_this_machine_needs(
    tmp_path: Path, cli_here: CliHere, cuda: bool, command: str
) -> None:
    assert install_command("vllm", cuda).startswith(command)
    assert install_command("tinker", cuda) == "pip install 'retrain[tinker]'"
    if importlib.util.find_spec("vllm") is None and not HAS_GPU:  # the finding a CPU machine without vLLM gets
        result = cli_here(["doctor", "experiment=quickstart", "inference=vllm", "--json"], tmp_path, check=False)
        [finding] = [f for f in json.loads(result.stdout)["findings"] if f["check"] == "extra"]
        assert finding["fix"].startswith("bash scripts/install-vllm-cpu.sh") and "retrain[vllm]" not in finding["fix"]
