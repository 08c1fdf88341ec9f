"""Secrets stay secret: environment values are never resolved into what is saved or shown, secret-looking
keys are masked, neither is part of a run's identity, and a key pasted where a variable's name belongs is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from retrain.config import compose
from retrain.errors import ConfigError
from retrain.housekeeping.launch import RunDirRefused, check_same_run
from retrain.housekeeping.secrets import (
    MASK,
    check_env_names,
    looks_secret,
    mask_text,
    masked_config,
    masked_override,
    shown_config,
)
from retrain.run import config_identity
from tests.conftest import QUICK, CliHere, read_metrics, run_cli

TOKEN, ROTATED = "tok-3f9a1c-first", "tok-77be02-rotated"
LITERAL_KEY = "sk-literal-5d0e41"  # typed on the command line: masked in every file, wandb's record of argv too
WITH_TOKEN = ["experiment=quickstart", "+reward.auth=${oc.env:MY_TOKEN}", "+reward.header=Bearer ${reward.auth}"]


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("reward.api_key", True),
        ("hf_token", True),
        ("apiKey", True),
        ("client_secret", True),
        ("db.password", True),
        ("training.max_tokens", False),  # a count of tokens, not a token
        ("model.tokenizer", False),
        ("reward.api_key_env", False),  # the name of the variable that holds the key
        ("training.keep_checkpoints", False),
    ],
)
def test_which_keys_look_secret(key: str, secret: bool) -> None:
    assert looks_secret(key) is secret


def test_environment_values_stay_interpolations_and_secrets_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    cfg = compose([*WITH_TOKEN, "+reward.hf_token=hf_literal_value", "training.lr=0.002"])
    assert cfg.reward.header == f"Bearer {TOKEN}"  # the plugin itself gets the value
    shown = shown_config(cfg)
    assert shown["reward"]["auth"] == "${oc.env:MY_TOKEN}"
    assert shown["reward"]["header"] == "Bearer ${oc.env:MY_TOKEN}"  # through another key's interpolation too
    assert shown["reward"]["hf_token"] == MASK and shown["training"]["lr"] == 0.002
    assert TOKEN not in str(shown) and "hf_literal_value" not in str(shown)
    written = str(masked_config(cfg))
    assert "${oc.env:MY_TOKEN}" in written and "hf_literal_value" not in written
    assert masked_override("+reward.hf_token=hf_literal_value") == f"+reward.hf_token={MASK}"
    assert masked_override("+reward.auth=${oc.env:MY_TOKEN}") == "+reward.auth=${oc.env:MY_TOKEN}"


def test_rotating_a_key_does_not_change_the_run_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_TOKEN", TOKEN)
    before = config_identity(compose([*WITH_TOKEN, "+reward.api_key=sk-first"]))
    monkeypatch.setenv("MY_TOKEN", ROTATED)
    after = config_identity(compose([*WITH_TOKEN, "+reward.api_key=sk-second"]))
    assert before == after
    assert TOKEN not in str(before) and "sk-first" not in str(before)


def test_an_identity_saved_with_a_resolved_token_neither_blocks_the_resume_nor_shows_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Checkpoints written before secrets were kept out of the identity hold the token itself."""
    monkeypatch.setenv("MY_TOKEN", ROTATED)
    current = config_identity(compose([*WITH_TOKEN, "+reward.api_key=sk-second"]))
    saved = {**current, "reward.auth": TOKEN, "reward.header": f"Bearer {TOKEN}", "reward.api_key": "sk-first"}
    check_same_run(saved, current, tmp_path)
    with pytest.raises(RunDirRefused) as refused:
        check_same_run({**saved, "training.lr": 0.5, "reward.other_key": "sk-gone"}, current, tmp_path)
    message = str(refused.value)
    assert "training.lr" in message and "reward.other_key" in message
    assert TOKEN not in message and "sk-first" not in message and "sk-gone" not in message


def test_a_key_pasted_into_an_env_name_setting_is_refused(tmp_path: Path, cli_here: CliHere) -> None:
    pasted = "sk-proj-Zx81qLw0"
    with pytest.raises(ConfigError, match=r"reward\.api_key_env must name an environment variable"):
        check_env_names(compose(["reward=judge", f"reward.api_key_env={pasted}"]))
    check_env_names(compose(["reward=judge", "reward.api_key_env=MY_JUDGE_KEY"]))

    run_dir = tmp_path / "run"
    result = cli_here(
        ["experiment=quickstart", "reward=judge", f"reward.api_key_env={pasted}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        check=False,
    )
    console = result.stdout + result.stderr
    assert result.returncode == 1 and "reward.api_key_env must name an environment variable" in console, console
    assert pasted not in console
    assert not (run_dir / ".hydra").exists() and "Loading train model" not in console  # refused before it is saved


def files_holding(root: Path, *values: str) -> list[str]:
    return [
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.is_file() and any(value.encode() in path.read_bytes() for value in values)
    ]


def test_a_token_from_the_environment_is_in_no_file_of_the_run_and_rotating_it_keeps_the_run(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = [
        "experiment=quickstart",
        "eval.num_examples=0",
        "logging.progress_bar=false",
        "scoring.workers=1",
        "training.batch_size=2",
        "training.group_size=2",
        "training.save_every=1",
        "reward._target_=tests.plugins.launch_plugins.token_reward",
        "+reward.auth=${oc.env:MY_TOKEN}",
        f"+reward.api_key={LITERAL_KEY}",
        "logging.wandb_project=retrain-test",
        f"hydra.run.dir={run_dir}",
    ]
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = run_cli([*args, "training.max_steps=1"], cwd=tmp_path, env={**offline, "MY_TOKEN": TOKEN})
    assert [r["reward/errors"] for r in read_metrics(run_dir)] == [0]  # the reward received the token itself
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb")), "no offline wandb run was written"
    assert files_holding(run_dir, TOKEN, LITERAL_KEY) == [] and TOKEN not in first.stdout + first.stderr

    resumed = run_cli([*args, "training.max_steps=2"], cwd=tmp_path, env={**offline, "MY_TOKEN": ROTATED})
    assert "Resumed from" in resumed.stdout
    assert [r["reward/errors"] for r in read_metrics(run_dir)] == [0, 0]
    assert files_holding(run_dir, TOKEN, ROTATED, LITERAL_KEY) == []


def test_the_inference_servers_url_is_not_part_of_the_run_identity() -> None:
    """A server restarted on another port (or behind new credentials) serves the same run."""
    server = ["experiment=quickstart", "inference=vllm_server"]
    first = config_identity(compose([*server, "inference.url=http://127.0.0.1:8000"]))
    moved = config_identity(compose([*server, "inference.url=http://10.0.0.7:8011"]))
    assert first == moved and "inference.url" not in first
    assert first["inference._target_"] == "retrain.inference.vllm_server.VllmServerEngine"


SWEPT_KEY, URL_PASSWORD = "sk-swept-7f3e9a", "pw-in-url-41c2"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("http://user:pw@host:8000/v1", "http://***@host:8000/v1"),
        ("http://user:p@ss@host:8000/v1", "http://***@host:8000/v1"),  # the user info ends at the LAST `@`
        (r"inference.url=http\://u\:p@s@s@127.0.0.1\:9", r"inference.url=http\://***@127.0.0.1\:9"),
        ("http://host/a?to=a@b then user@example.com", "http://host/a?to=a@b then user@example.com"),
        (r"inference.url=http\://user\:pw@127.0.0.1\:9", r"inference.url=http\://***@127.0.0.1\:9"),
        ("GET https://a:b@x/y: ConnectError", "GET https://***@x/y: ConnectError"),
        ("Authorization: Bearer abc.def-123", "Authorization: ***"),
        ('{"authorization": "Basic dXNlcjpwYXNz"}', '{"authorization": "***"}'),
        ("header=Bearer abcdefgh12", "header=Bearer ***"),
        ("key sk-proj-0123456789abcdefghijkl here", "key *** here"),
        ("\t#0 : +reward.api_key=sk-1 training.seed=1", "\t#0 : +reward.api_key=*** training.seed=1"),
        ("+reward.api_key=sk-1,training.seed=1", "+reward.api_key=***,training.seed=1"),
        ("['+reward.api_key=sk-1', 'x=1']", "['+reward.api_key=***', 'x=1']"),
        ("reward.api_key_env=sk-pasted", "reward.api_key_env=***"),
        # what stays: no secret, a variable's name, an interpolation, a mail address, a Hub id
        ("training.max_tokens=8 leaves 120", "training.max_tokens=8 leaves 120"),
        ("reward.api_key_env=MY_KEY", "reward.api_key_env=MY_KEY"),
        ("+reward.token=${oc.env:MY_TOKEN}", "+reward.token=${oc.env:MY_TOKEN}"),
        ("Bearer ${oc.env:MY_TOKEN}", "Bearer ${oc.env:MY_TOKEN}"),
        ("ask user@example.com", "ask user@example.com"),
        ("data.path=hf_internal_testing/x", "data.path=hf_internal_testing/x"),
    ],
)
def test_secrets_are_masked_by_their_shape_and_their_key(text: str, shown: str) -> None:
    assert mask_text(text) == shown


def test_a_url_with_credentials_is_masked_in_any_setting_and_kept_out_of_the_identity() -> None:
    cfg = compose(["experiment=quickstart", f"+reward.base_url=http://judge:{URL_PASSWORD}@10.0.0.2:8000/v1"])
    assert cfg.reward.base_url.startswith("http://judge:")  # the plugin itself gets the credentials
    assert shown_config(cfg)["reward"]["base_url"] == "http://***@10.0.0.2:8000/v1"
    assert URL_PASSWORD not in str(config_identity(cfg)) + str(OmegaConf.to_container(masked_config(cfg)))


def test_explain_and_doctor_show_no_key_and_no_url_credentials(tmp_path: Path, cli_here: CliHere) -> None:
    args = [
        "experiment=quickstart",
        f"+reward.api_key={SWEPT_KEY}",
        "inference=vllm_server",
        f"inference.url=http://user:{URL_PASSWORD}@127.0.0.1:9",
    ]
    for command in (["explain"], ["explain", "--json"], ["doctor", "--json"]):
        result = cli_here([*command, *args], tmp_path, check=False)
        shown = result.stdout + result.stderr
        assert SWEPT_KEY not in shown and URL_PASSWORD not in shown, command
        if "--json" in command:  # the report lists the overrides: masked, not left out
            assert "+reward.api_key=***" in shown and "http://***@127.0.0.1" in shown, (command, shown)
    pasted = cli_here(
        ["doctor", "experiment=quickstart", "reward=judge", f"reward.api_key_env={SWEPT_KEY}"], tmp_path, check=False
    )
    assert pasted.returncode == 1 and "BLOCKING: reward.api_key_env must name an environment variable" in pasted.stdout
    assert SWEPT_KEY not in pasted.stdout + pasted.stderr


def test_a_key_and_url_credentials_typed_for_a_sweep_are_in_no_file_and_no_line(tmp_path: Path) -> None:
    """multirun.yaml, Hydra's `#0 : ...` launch line, the failed job's error and its run dir's files."""
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        [
            "--multirun",
            "experiment=quickstart",
            "eval.num_examples=0",
            f"+reward.api_key={SWEPT_KEY}",
            "inference=vllm_server",
            f"inference.url=http://user:{URL_PASSWORD}@127.0.0.1:9",  # nothing listens: the job fails at start
            "inference.max_retries=0",
            "training.seed=1",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        cwd=tmp_path,
        check=False,
    )
    console = result.stdout + result.stderr
    assert "#0 : " in console and "+reward.api_key=*** " in console, console
    assert "inference.url: no server answers (GET http://***@127.0.0.1:9/" in console, console
    assert SWEPT_KEY not in console and URL_PASSWORD not in console, console
    assert (sweep_dir / "multirun.yaml").is_file() and list(sweep_dir.glob("*/run.log"))
    assert files_holding(sweep_dir, SWEPT_KEY, URL_PASSWORD) == []
    status = subprocess.run(
        [sys.executable, "-m", "retrain", "status", str(sweep_dir), "--json"], capture_output=True, text=True
    )
    assert "http://***@127.0.0.1:9" in status.stdout and URL_PASSWORD not in status.stdout


def test_a_password_holding_an_at_sign_is_in_no_file_and_no_line_of_a_run(tmp_path: Path) -> None:
    """`user:p@ss@host`: an unencoded `@` in the password; run.log, .hydra/*, job.json, status.json, the console."""
    run_dir, password = tmp_path / "run", "p@ss-9d1e"
    result = run_cli(
        [
            *QUICK,
            "inference=vllm_server",
            f"inference.url=http://user:{password}@127.0.0.1:9",  # nothing listens: the run fails at start
            "inference.max_retries=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        check=False,
    )
    console = result.stdout + result.stderr
    assert result.returncode == 1 and "no server answers (GET http://***@127.0.0.1:9/" in console, console
    written = {"run.log", "job.json", "status.json", ".hydra/config.yaml", ".hydra/overrides.yaml"}
    assert written <= {str(path.relative_to(run_dir)) for path in run_dir.rglob("*")}
    assert "ss-9d1e" not in console and files_holding(run_dir, "ss-9d1e") == []
