"""The command line as a user meets it: help, the composed config, and errors that name the key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from retrain.cli import flags_before_overrides
from retrain.model.spec import bundled_asset_dir
from tests.conftest import CliHere, cli_env, run_cli


def test_help_lists_every_group(tmp_path: Path, cli_here: CliHere) -> None:
    out = cli_here(["--help"], cwd=tmp_path).stdout
    for group in ["backend", "model", "algorithm", "inference", "reward", "data", "experiment"]:
        assert f"{group}:" in out, f"--help does not list group {group}"
    assert "maxrl_gtpo_sepa" in out and "quickstart" in out


def test_cfg_job_prints_the_composed_config(tmp_path: Path, cli_here: CliHere) -> None:
    out = cli_here(["--cfg", "job", "experiment=quickstart", "training.lr=0.002"], cwd=tmp_path).stdout
    assert "lr: 0.002" in out
    assert "_target_: retrain.data.arithmetic.ArithmeticData" in out


def test_flags_may_come_between_the_overrides(tmp_path: Path, cli_here: CliHere) -> None:
    out = cli_here(["experiment=quickstart", "--cfg", "job", "training.lr=0.002", "-p", "training"], tmp_path).stdout
    assert "lr: 0.002" in out and "_target_: retrain.data" not in out  # both overrides, and the package flag


@pytest.mark.parametrize(
    ("arguments", "reordered"),
    [
        (["a=1", "-m", "b=2"], ["-m", "a=1", "b=2"]),
        (["a=1", "-cn", "mine", "b=2", "--cfg=job"], ["-cn", "mine", "--cfg=job", "a=1", "b=2"]),
        (["a=1", "--info", "defaults", "b=2"], ["--info", "defaults", "a=1", "b=2"]),  # a value among its choices
        (["a=1", "--info", "b=2"], ["--info", "a=1", "b=2"]),  # an override is not --info's value
        (["training.lr=-1", "~key", "+key=2"], ["training.lr=-1", "~key", "+key=2"]),
    ],
)
def test_flags_are_moved_ahead_of_the_overrides_in_their_order(arguments: list[str], reordered: list[str]) -> None:
    assert flags_before_overrides(arguments) == reordered


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["training.lrr=1"], "retrain: unknown config key 'training.lrr'; did you mean 'training.lr'? (known: "),
        (["training.batch_size=eight"], "retrain: training.batch_size=eight: Value 'eight' of type 'str' could not"),
        (["algorithm=no_such_algorithm"], "retrain: algorithm=no_such_algorithm: no such option (options: "),
        (["--cfg", "job", "trainig.lr=1"], "retrain: unknown config key 'trainig'; did you mean 'training'?"),
        (["--multirun", "training.lrr=1"], "retrain: unknown config key 'training.lrr'; did you mean 'training.lr'?"),
        (["--config-dir", "nosuch"], "retrain: Additional config directory '"),
        (["hydra.run.dir=${nosuch}"], "retrain: hydra.run.dir: its interpolation cannot be resolved: Interpolation"),
        (
            ["--multirun", "hydra.sweep.dir=${oc.env:RETRAIN_TEST_UNSET}"],
            "retrain: hydra.sweep.dir: its interpolation cannot be resolved: Environment variable 'RETRAIN_TEST_UNSET'",
        ),
    ],
)
def test_compose_errors_read_as_one_line_naming_the_key_or_option(
    tmp_path: Path, cli_here: CliHere, arguments: list[str], line: str
) -> None:
    result = cli_here(arguments, cwd=tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.startswith(line), result.stderr
    assert result.stderr.count("\n") == 1 and not result.stdout  # not Hydra's lines and HYDRA_FULL_ERROR advice
    # nothing was trained: no run dir was created for a config that does not compose
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


def test_hydra_full_error_keeps_the_traceback_of_a_compose_error(
    tmp_path: Path, cli_here: CliHere, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hydra.errors import ConfigCompositionException

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigCompositionException, match="training.lrr"):
        cli_here(["training.lrr=1"], cwd=tmp_path)


def test_a_typo_in_the_key_a_sweep_varies_is_named_before_the_sweep_starts(tmp_path: Path, cli_here: CliHere) -> None:
    """Not "jobs #0, #1 would share the run dir": the jobs do not compose."""
    result = cli_here(["--multirun", "trainig.lr=1e-3,1e-4", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, False)
    assert result.returncode == 1 and not (tmp_path / "sweep").exists()
    assert result.stderr.startswith("retrain: job #0: unknown config key 'trainig'; did you mean 'training'?")


def test_a_typo_added_with_plus_is_refused_before_anything_loads(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(
        ["experiment=quickstart", "+training.lrr=1e-4", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, check=False
    )
    assert result.returncode != 0
    # the hint a typo Hydra refuses gets (retrain/config_checks/compose_errors.py)
    assert "unknown config key 'training.lrr'; did you mean 'training.lr'?" in result.stdout + result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# mistakes found before torch and transformers import: (overrides, what the one-line message starts with)
START_UP_MISTAKES = [
    (["data=gsm8k", "data.path=/nope.jsonl"], "data.path='/nope.jsonl': no such file or directory"),
    (["data=jsonl", "data.path=nope.jsonl"], "data.path='nope.jsonl': no such file or directory"),
    (["data=math", "data.path=./nope"], "data.path='./nope': no such file or directory"),
    (["data=agent", "data.tasks=/nope.jsonl", "data.agent=a:b"], "data.tasks='/nope.jsonl': no such file or directory"),
    (["model.name_or_path=/nope"], "model.name_or_path='/nope': no such file or directory"),
    (["model.name_or_path=../nope"], "model.name_or_path='../nope': no such file or directory"),
    (["training.kl_coef=-1"], "training.kl_coef must be >= 0"),
    (["eval.every=5", "eval.num_examples=0"], "eval.every=5 needs held-out problems"),
    (["+training.lrr=1"], "unknown config key 'training.lrr'; did you mean 'training.lr'?"),
]
# one process tries each mistake in turn and says, after each, which of torch and transformers it has imported
FIRST_IMPORTS = """
import json, sys
from retrain.cli import main
for number, args in enumerate(json.loads(sys.argv[1])):
    sys.argv = ["retrain", *args]
    try:
        code = main()
    except SystemExit as exit:
        code = exit.code
    imported = sorted({"torch", "transformers"} & set(sys.modules))
    print(f"@@ {number} exit {code} imported {imported}", flush=True)
"""


def test_start_up_mistakes_are_refused_before_torch_and_transformers_import(tmp_path: Path) -> None:
    """A missing data file or local model, a value out of range, a `+key` typo: refused in a second or two, not
    after the 10-20 s torch and transformers take to import on a busy machine (what a timing cannot show)."""
    runs = [
        ["experiment=quickstart", *overrides, f"hydra.run.dir={tmp_path / str(number)}"]
        for number, (overrides, _) in enumerate(START_UP_MISTAKES)
    ]
    result = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS, json.dumps(runs)],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    console = [line for line in result.stdout.splitlines() if line.startswith(("retrain: ", "@@ "))]
    for number, (_, message) in enumerate(START_UP_MISTAKES):
        assert console[2 * number].startswith(f"retrain: {message}"), console
        assert console[2 * number + 1] == f"@@ {number} exit 1 imported []", console


def test_preflight_refuses_token_credit_on_a_backend_that_aggregates_it(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(
        [
            "experiment=quickstart",
            "algorithm=maxrl_gtpo_sepa",
            "backend._target_=tests.plugins.training_plugins.ScalarAdvantageBackend",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        check=False,
    )
    message = result.stdout + result.stderr
    assert result.returncode != 0
    assert "maxrl_gtpo_sepa" in message and "ScalarAdvantageBackend" in message
    # the startup line: the capabilities the plugin declared through its hook, and where they came from
    assert (
        "backend tests.plugins.training_plugins.ScalarAdvantageBackend: reports_sync_loss=False, "
        "preserves_token_advantages=False, supports_checkpoint_resume=True"
    ) in message
    assert "(source=plugin/hook)" in message
    assert "preflight should have stopped" not in message


ERRORS = "tests.plugins.error_plugins"
# kind -> (overrides, environment, what the one-line message must name)
USER_ERRORS = {
    "config": (["scoring.timeout_s=0"], {}, "scoring.timeout_s"),
    "unimportable target": (
        [f"reward._target_={ERRORS}.no_such_reward"],
        {},
        f"reward._target_='{ERRORS}.no_such_reward'",
    ),
    "a name its module does not hold": (
        ["algorithm.advantage._target_=tests.plugins.algorithm_plugins.sign_advantag"],
        {},
        "cannot be imported: module 'tests.plugins.algorithm_plugins' has no 'sign_advantag'; did you mean "
        "'sign_advantage'?",
    ),
    "unreadable data": (["data=jsonl", "data.path={tmp}/broken.jsonl"], {}, "broken.jsonl': cannot read the records"),
    "hub": (
        ["model.name_or_path=retrain-tests/no-such-model"],
        {"HF_HUB_OFFLINE": "1"},
        "'retrain-tests/no-such-model'",
    ),
    "reward output": ([f"reward._target_={ERRORS}.text_reward"], {}, f"reward {ERRORS}.text_reward returned '"),
    "reward worker": (
        [f"reward._target_={ERRORS}.UnloadableReward", "reward._partial_=false"],
        {},
        f"could not load reward {ERRORS}.UnloadableReward (RuntimeError: this reward holds",
    ),
    "plugin output": (
        ["algorithm.advantage._target_=tests.plugins.algorithm_plugins.wrong_shape_advantage"],
        {},
        "tests.plugins.algorithm_plugins.wrong_shape_advantage",
    ),
    "unresolvable interpolation": (
        ["+reward.token=${{oc.env:RETRAIN_TEST_UNSET}}"],  # braces doubled: formatted with {tmp}
        {},
        "reward.token: its interpolation cannot be resolved: Environment variable 'RETRAIN_TEST_UNSET' not found",
    ),
    "argument a function does not take": (
        ["+algorithm.advantage.scal=2.0"],
        {},
        "failed on a synthetic step, before training: maxrl() got an unexpected keyword argument 'scal'",
    ),
    "argument a constructor does not take": (
        ["+algorithm.transforms.gtpo.betaa=0.2"],
        {},
        "algorithm.transforms.gtpo: retrain.algorithm.transforms.GTPOWeighting does not take its arguments",
    ),
    "plugin that raises": (
        ["algorithm.advantage._target_=tests.plugins.algorithm_plugins.failing_advantage"],
        {},
        "episode advantage tests.plugins.algorithm_plugins.failing_advantage raised IndexError: index 9 is out",
    ),
    "plugin that raises as it is built": (
        [f"data._target_={ERRORS}.DataNeedingAFile"],
        {},
        f"data._target_='{ERRORS}.DataNeedingAFile' raised FileNotFoundError as it was built: [Errno 2] ",
    ),
    "model directory without config.json": (
        ["model.name_or_path={tmp}/empty"],
        {},
        "/empty' holds no config.json, so it is not a model's directory (it holds: nothing)",
    ),
    "model directory without a tokenizer": (
        ["model.name_or_path={tmp}/config_only"],
        {},
        "/config_only' holds no tokenizer file (none of tokenizer.json, ",
    ),
    "model weights cut short": (
        ["model.name_or_path={tmp}/cut_short"],
        {},
        "/cut_short': cannot load its weights: Error while deserializing header",
    ),
    "squeeze block": (["+squeeze.min_variance_retention=1.5"], {}, "squeeze.min_variance_retention=1.5"),
    "wandb without a key": (
        ["logging.wandb_project=retrain-tests"],
        {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": "{tmp}", "WANDB_CONFIG_DIR": "{tmp}"},
        "logging.wandb_project='retrain-tests': wandb cannot start: ",  # then wandb's words, which change
    ),
    "wandb with a malformed key": (
        ["logging.wandb_project=retrain-tests"],
        {"WANDB_MODE": "online", "WANDB_API_KEY": "abc", "HOME": "{tmp}", "WANDB_CONFIG_DIR": "{tmp}"},
        "logging.wandb_project='retrain-tests': wandb cannot start: ",
    ),
}
BEFORE_THE_DATA_LOADS = {"wandb without a key", "wandb with a malformed key"}  # not after minutes of a model's loading


@pytest.mark.parametrize("kind", USER_ERRORS)
def test_a_users_mistake_reads_as_one_message_with_the_traceback_in_run_log(
    tmp_path: Path, kind: str, cli_here: CliHere
) -> None:
    overrides, env, named = USER_ERRORS[kind]
    (tmp_path / "broken.jsonl").write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": \n')
    _broken_model_dirs(tmp_path)
    run_dir = tmp_path / "run"
    args = [
        "experiment=quickstart",
        "eval.num_examples=0",
        "training.max_steps=1",
        "logging.progress_bar=false",
        f"hydra.run.dir={run_dir}",
        *(o.format(tmp=tmp_path) for o in overrides),
    ]
    if env:  # in a process of its own: wandb and the Hub read their environment once per process
        result = run_cli(
            args, tmp_path, env={key: value.format(tmp=tmp_path) for key, value in env.items()}, check=False
        )
    else:
        result = cli_here(args, tmp_path, check=False)
    console = result.stdout + result.stderr
    assert result.returncode == 1, console
    assert "Traceback" not in console, console
    messages = [line for line in console.splitlines() if line.startswith("retrain: ")]
    assert len(messages) == 1 and named in messages[0], console
    assert f"traceback in {run_dir / 'run.log'}" in messages[0]
    log = (run_dir / "run.log").read_text()
    assert messages[0] in log and "Traceback (most recent call last)" in log, log
    if kind in BEFORE_THE_DATA_LOADS:
        assert "Loaded " not in log and "ready" not in log, log


def _broken_model_dirs(root: Path) -> None:
    """Model directories as a failed download or copy leaves them: empty, without a tokenizer, weights cut short."""
    tiny = bundled_asset_dir("tiny_qwen3")
    (root / "empty").mkdir()
    (root / "config_only").mkdir()
    shutil.copy(tiny / "config.json", root / "config_only")
    shutil.copytree(tiny, root / "cut_short")
    weights = root / "cut_short" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["hydra.run.dir={blocker}"], "retrain: cannot write the output dir (hydra.run.dir): File exists: '{blocker}'"),
        (
            ["hydra.run.dir={blocker}/run"],
            "retrain: cannot write the output dir (hydra.run.dir): Not a directory: '{blocker}/run'",
        ),
        (
            ["--multirun", "hydra.sweep.dir={blocker}"],
            "retrain: cannot write the output dir (hydra.sweep.dir): File exists: '{blocker}'",
        ),
        (
            ["--multirun", "hydra.sweep.dir={tmp}/sweep", "hydra.sweep.subdir=../a_file"],
            "retrain: cannot write the output dir (hydra.sweep.dir + hydra.sweep.subdir): File exists: ",
        ),
    ],
)
def test_an_output_dir_that_cannot_be_made_is_one_line_naming_its_key(
    tmp_path: Path, cli_here: CliHere, arguments: list[str], line: str
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    names = {"blocker": blocker, "tmp": tmp_path}
    args = ["experiment=quickstart", "training.max_steps=1", *(a.format(**names) for a in arguments)]
    result = cli_here(args, tmp_path, check=False)
    assert result.returncode == 1 and result.stderr.startswith(line.format(**names)), result.stderr
    assert result.stderr.count("\n") == 1 and blocker.read_text() == "not a directory"


@pytest.fixture
def read_only_run_dir(tmp_path: Path) -> Iterator[Path]:
    """A run dir holding a run's files on a file system mounted read-only (a tmpfs: needs root's
    CAP_SYS_ADMIN, as in the dev container; skipped where mounting is not allowed)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount_point)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        run_dir = mount_point / "run"
        run_dir.mkdir()
        (run_dir / "run.log").write_text("an earlier attempt's log\n")
        subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
        yield run_dir
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_an_existing_run_dir_on_a_read_only_file_system_is_one_line(
    tmp_path: Path, cli_here: CliHere, read_only_run_dir: Path
) -> None:
    args = ["experiment=quickstart", "training.max_steps=1", f"hydra.run.dir={read_only_run_dir}"]
    result = cli_here(args, tmp_path, check=False)
    assert result.returncode == 1 and result.stderr == (
        f"retrain: cannot write the output dir (hydra.run.dir): Read-only file system: '{read_only_run_dir}/run.log'\n"
    ), result.stderr


def test_a_dotenv_file_in_the_working_directory_is_loaded_and_the_environment_wins(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("RETRAIN_TEST_FROM_DOTENV=from-file\nRETRAIN_TEST_BOTH=from-file\n")
    result = run_cli(
        [
            "experiment=quickstart",
            "+reward.note=${oc.env:RETRAIN_TEST_FROM_DOTENV}/${oc.env:RETRAIN_TEST_BOTH}",
            "--cfg",
            "job",
            "--resolve",
        ],
        cwd=tmp_path,
        env={"RETRAIN_TEST_BOTH": "from-environment"},
    )
    assert "note: from-file/from-environment" in result.stdout


@pytest.mark.slow
def test_prime_rl_takes_token_credit_past_preflight(tmp_path: Path) -> None:
    """Before any model loads (offline, with nothing cached: loading one would fail otherwise): PRIME-RL's loss
    takes advantages per token, so a token-varying algorithm passes preflight like a scalar one and stops at
    the first thing the run lacks, the PRIME-RL output_dir."""
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    for algorithm in ("maxrl_gtpo_sepa", "maxrl_none"):
        result = run_cli(
            ["backend=prime_rl", f"algorithm={algorithm}", f"hydra.run.dir={tmp_path / algorithm}"],
            cwd=tmp_path,
            env=offline,
            check=False,
        )
        message = result.stdout + result.stderr
        assert result.returncode == 1 and "cannot run on backend" not in message
        assert "backend.output_dir is required" in message


def test_a_mistyped_command_is_named_with_the_commands(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(["statsu"], tmp_path, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "retrain: unknown command 'statsu'; did you mean `retrain status`? commands: status, squeeze" in result.stderr
    )


def test_version_prints_retrains_own(tmp_path: Path, cli_here: CliHere) -> None:
    result = cli_here(["--version"], tmp_path)
    assert result.stdout.strip() == f"retrain {version('retrain')}" and "Hydra" not in result.stdout


@pytest.mark.parametrize("path", ["old.toml", "configs/old.toml"])
def test_a_seeds_toml_config_points_to_migrate_config(tmp_path: Path, cli_here: CliHere, path: str) -> None:
    result = cli_here([path, "training.seed=1"], tmp_path, check=False)
    assert result.returncode == 2 and "override" not in result.stderr, result.stderr
    assert f"`retrain migrate-config {path}`" in result.stderr


def test_the_retrain_script_imports_plugins_from_the_working_directory(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "retrain"
    if not script.exists():
        pytest.skip("retrain is not installed as a script beside this interpreter")
    (tmp_path / "my_advantages.py").write_text(
        "def centred(rewards):\n    return rewards - rewards.mean(dim=1, keepdim=True)\n"
    )
    arguments = ["explain", "experiment=quickstart", "algorithm.advantage._target_=my_advantages.centred"]
    result = subprocess.run([str(script), *arguments], cwd=tmp_path, env=cli_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # as under `python -m retrain`, whose path starts with the cwd
    assert "my_advantages.centred" in result.stdout
