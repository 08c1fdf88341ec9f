"""`retrain migrate-config`: TOML configs of the original format become Hydra presets that compose to the same settings.

Fixtures: mini.toml (the original retrain's minimal example) and annotated.toml (its full annotated config),
both verbatim from the original retrain's documentation, and pilot.toml, a campaign TOML. Each written preset is composed as `--config-dir DIR` would
(Hydra's search path) and checked key by key.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from retrain.commands.migrate_config import main
from retrain.config import compose
from tests.conftest import run_cli

FIXTURES = Path(__file__).parent / "fixtures"


def migrate(tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: Path | str, *flags: str) -> tuple[int, str, str]:
    """Run the command in-process on a fixture path or on TOML text (written to tmp_path/old.toml)."""
    if isinstance(toml, str):
        path = tmp_path / "old.toml"
        path.write_text(textwrap.dedent(toml))
    else:
        path = toml
    rc = main([str(path), "--output-dir", str(tmp_path / "conf"), *flags])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def composed(config_dir: Path, choice: str) -> DictConfig:
    """The config `python -m retrain --config-dir <config_dir> <choice>` composes, resolved, hydra node included."""
    cfg = compose([f"hydra.searchpath=['file://{config_dir}']", choice], return_hydra_config=True)
    container = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(container, dict)
    hydra_node = container.pop("hydra")  # `${now:...}` and friends resolve only inside a running Hydra app
    resolved = OmegaConf.to_container(OmegaConf.create(container), resolve=True)
    assert isinstance(resolved, dict)
    return OmegaConf.create({**resolved, "hydra": hydra_node})


def assert_values(cfg: DictConfig, expected: dict[str, object]) -> None:
    for key, value in expected.items():
        assert OmegaConf.select(cfg, key) == value, key


def test_mini_toml_becomes_an_experiment_preset_with_the_same_settings(tmp_path, capsys):
    rc, out, _ = migrate(tmp_path, capsys, FIXTURES / "mini.toml")
    assert rc == 0
    preset = tmp_path / "conf" / "experiment" / "mini.yaml"
    assert f"wrote {preset}" in out
    assert '[backend] adapter_path = "adapters/mini"' in out  # reported, and kept as a comment in the preset
    assert '[backend] adapter_path = "adapters/mini"' in preset.read_text()
    cfg = composed(tmp_path / "conf", "experiment=mini")
    assert_values(
        cfg,
        {
            "algorithm.name": "grpo_none",
            "algorithm.advantage._target_": "retrain.algorithm.advantages.grpo",
            "algorithm.transforms": {},
            "backend._target_": "retrain.backend.local.LocalBackend",
            "model.name_or_path": "Qwen/Qwen3-4B-Instruct-2507",
            "training.max_steps": 20,
            "training.batch_size": 2,
            "training.group_size": 8,
            "training.max_tokens": 1024,
            "training.lr": 4e-5,
            "hydra.run.dir": "logs/mini",
        },
    )


def test_the_written_preset_runs_from_the_command_line(tmp_path, capsys):
    assert migrate(tmp_path, capsys, FIXTURES / "mini.toml")[0] == 0
    result = run_cli(["--config-dir", "conf", "experiment=mini", "--cfg", "job", "--resolve"], cwd=tmp_path)
    job = yaml.safe_load(result.stdout)
    assert job["algorithm"]["name"] == "grpo_none"
    assert job["training"]["max_steps"] == 20 and job["training"]["group_size"] == 8


def test_the_annotated_full_config_migrates_key_by_key(tmp_path, capsys):
    rc, out, _ = migrate(tmp_path, capsys, FIXTURES / "annotated.toml")
    assert rc == 0
    cfg = composed(tmp_path / "conf", "experiment=annotated")
    assert_values(
        cfg,
        {
            "backend._target_": "retrain.backend.local.LocalBackend",
            "backend.devices": "gpu:0",
            "model.name_or_path": "Qwen/Qwen3-4B-Instruct-2507",
            "model.lora_rank": 32,
            "model.dtype": "auto",
            "algorithm.name": "maxrl_gtpo_sepa",
            "algorithm.uncertainty": "surprisal",
            "algorithm.gtpo.beta": 0.1,
            "algorithm.hicra.alpha": 0.2,
            "algorithm.sepa.steps": 500,
            "algorithm.sepa.schedule": "linear",
            "algorithm.sepa.delay_steps": 50,
            "algorithm.sepa.correct_rate_gate": 0.1,
            "inference._target_": "retrain.inference.pytorch.PytorchEngine",
            "inference.prefix_caching": True,
            "inference.attention_kernel": "default",
            "reward._target_": "retrain.reward.match.match_reward",
            "data._target_": "retrain.data.math.MathData",
            "data.max_examples": 0,
            "training.seed": -1,
            "training.max_steps": 500,
            "training.batch_size": 8,
            "training.group_size": 16,
            "training.max_tokens": 10240,
            "training.temperature": 0.7,
            "training.lr": 4e-5,
            "training.weight_decay": 0.0,
            "training.save_every": 20,
            "backpressure.enabled": False,
            "backpressure.warmup_steps": 10,
            "backpressure.ema_decay": 0.9,
            "backpressure.throttle_margin": 0.85,
            "backpressure.increase_margin": 0.5,
            "backpressure.min_batch_size": 1,
            "backpressure.max_batch_size": 64,
            "backpressure.peak_gflops": 0.0,
            "backpressure.peak_bw_gb_s": 0.0,
            "squeeze.min_variance_retention": 0.95,
            "resume.from": "",
            "logging.wandb_project": "",
            "logging.wandb_tags": [],
            "hydra.run.dir": "logs/train",
        },
    )
    # the prime_rl example options do not apply to backend=local: reported, never silently lost
    for dropped in (
        "[backend.options] transport",
        "[backend.options] sync_poll_s",
        "[plugins] search_paths",
        "[inference] kv_cache_dtype",
        "[environment] provider",
        "[backend] adapter_path",
    ):
        assert dropped in out


def test_every_hyper_parameter_reaches_its_hydra_key(tmp_path, capsys):
    rc, _, err = migrate(
        tmp_path,
        capsys,
        """
        [backend]
        devices = "cpu"
        [model]
        model = "retrain:tiny_qwen3"
        lora_rank = 8
        [lora]
        alpha = 24
        dropout = 0.05
        [algorithm]
        advantage_mode = "grpo"
        transform_mode = "gtpo_hicra"
        uncertainty_kind = "predictive_variance"
        entropy_mask_rho = 0.2
        [optimizer]
        beta1 = 0.8
        beta2 = 0.99
        eps = 1e-6
        [training]
        seed = 7
        top_p = 1.0
        [gtpo]
        beta = 0.3
        [hicra]
        alpha = 0.4
        [sepa]
        schedule = "auto"
        [inference]
        engine = "vllm"
        dtype = "bf16"
        kv_cache_dtype = "fp8"
        attention_kernel = "flash"
        [reward]
        type = "judge"
        judge_model = "gpt-4.1-mini"
        [data]
        source = "gsm8k"
        [logging]
        wandb_project = "p"
        wandb_tags = "a, b"
        strategic_grams = "let me think, wait"
        [resume]
        from = "logs/old"
    """,
    )
    assert rc == 0, err
    cfg = composed(tmp_path / "conf", "experiment=old")
    assert_values(
        cfg,
        {
            "backend.devices": "cpu",
            "model.name_or_path": "retrain:tiny_qwen3",
            "model.lora_rank": 8,
            "model.lora_alpha": 24,
            "model.lora_dropout": 0.05,
            "algorithm.name": "grpo_gtpo_hicra",
            "algorithm.uncertainty": "predictive_variance",
            "algorithm.surprisal_mask_rho": 0.2,
            "algorithm.gtpo.beta": 0.3,
            "algorithm.transforms.gtpo.beta": 0.3,
            "algorithm.hicra.alpha": 0.4,
            "algorithm.transforms.hicra.alpha": 0.4,
            "algorithm.sepa.schedule": "auto",
            "algorithm.planning.grams": ["let me think", "wait"],
            "training.betas": [0.8, 0.99],
            "training.eps": 1e-6,
            "training.seed": 7,
            "training.top_p": 1.0,
            "inference._target_": "retrain.inference.vllm.VllmEngine",
            "inference.dtype": "bf16",
            "inference.kv_cache_dtype": "fp8",
            "inference.attention_kernel": "flash",
            "reward._target_": "retrain.reward.judge.JudgeReward",
            "reward.model": "gpt-4.1-mini",
            "data._target_": "retrain.data.gsm8k.Gsm8kData",
            "logging.wandb_project": "p",
            "logging.wandb_tags": ["a", "b"],
            "resume.from": "logs/old",
        },
    )


def test_plugin_modes_become_targets_and_their_params_arguments(tmp_path, capsys):
    rc, _, err = migrate(
        tmp_path,
        capsys,
        """
        [algorithm]
        algorithm_mode = "my_algos.full_algorithm"
        advantage_mode = "my_advantages.signed"
        transform_mode = "my_transforms.clip"
        [algorithm.params]
        alpha = 0.1
        [algorithm.advantage_params]
        scale = 2.0
        [algorithm.transform_params]
        cap = 0.2
        [reward]
        type = "custom"
        custom_module = "my_rewards"
        custom_function = "exact"
    """,
    )
    assert rc == 0, err
    cfg = composed(tmp_path / "conf", "experiment=old")
    assert_values(
        cfg,
        {
            "algorithm._target_": "my_algos.full_algorithm",
            "algorithm.alpha": 0.1,  # the plugin algorithm's own keyword argument
            "algorithm.advantage._target_": "my_advantages.signed",
            "algorithm.advantage.scale": 2.0,
            "algorithm.transforms": {"clip": {"_target_": "my_transforms.clip", "cap": 0.2}},
            "algorithm.name": "signed_clip",
            "reward._target_": "my_rewards.exact",
        },
    )


def test_a_builtin_algorithm_mode_picks_that_condition(tmp_path, capsys):
    rc, out, _ = migrate(
        tmp_path,
        capsys,
        """
        [algorithm]
        algorithm_mode = "maxrl_gtpo"
        advantage_mode = "grpo"
    """,
    )
    assert rc == 0
    assert composed(tmp_path / "conf", "experiment=old").algorithm.name == "maxrl_gtpo"
    assert '[algorithm] advantage_mode = "grpo": replaced by algorithm_mode' in out


def test_legacy_prime_rl_keys_become_backend_options(tmp_path, capsys):
    rc, _, err = migrate(
        tmp_path,
        capsys,
        """
        [backend]
        backend = "prime_rl"
        adapter_path = "/runs/prime/output"
        prime_rl_transport = "zmq"
        prime_rl_zmq_host = "10.0.0.2"
        prime_rl_zmq_port = 7777
        prime_rl_zmq_hwm = 20
        prime_rl_strict_advantages = true
        prime_rl_sync_wait_s = 60
        prime_rl_sync_poll_s = 0.5
        [algorithm]
        transform_mode = "none"
        [inference]
        url = "http://10.0.0.3:8000"
    """,
    )
    assert rc == 0, err
    assert_values(
        composed(tmp_path / "conf", "experiment=old"),
        {
            "backend.output_dir": "/runs/prime/output",
            "backend.transport": "zmq",
            "backend.zmq_host": "10.0.0.2",
            "backend.zmq_port": 7777,
            "backend.zmq_hwm": 20,
            "backend.strict_advantages": True,
            "backend.sync_wait_s": 60,
            "backend.sync_poll_s": 0.5,
            "backend.inference_url": "http://10.0.0.3:8000",
            "algorithm.name": "maxrl_none",
        },
    )


def test_tinker_backend_takes_the_service_url(tmp_path, capsys):
    rc, out, err = migrate(
        tmp_path,
        capsys,
        """
        [backend]
        backend = "tinker"
        devices = "gpu:0"
        [model]
        base_url = "https://tinker.example"
        [inference]
        engine = "vllm"
    """,
    )
    assert rc == 0, err
    cfg = composed(tmp_path / "conf", "experiment=old")
    assert cfg.backend.base_url == "https://tinker.example"
    assert '[inference] engine = "vllm": backend=tinker samples on the Tinker service' in out
    assert "[backend] devices" in out


def test_a_verifiers_environment_becomes_data_verifiers(tmp_path, capsys):
    rc, _, err = migrate(
        tmp_path,
        capsys,
        """
        [environment]
        provider = "verifiers"
        id = "primeintellect/gsm8k"
        args = { split = "train" }
        auto_install = true
        max_turns = 8
    """,
    )
    assert rc == 0, err
    assert_values(
        composed(tmp_path / "conf", "experiment=old"),
        {
            "data.id": "primeintellect/gsm8k",
            "data.args": {"split": "train"},
            "data.auto_install": True,
            "data.max_turns": 8,
        },
    )


def test_a_campaign_toml_becomes_a_campaign_preset(tmp_path, capsys):
    rc, out, err = migrate(tmp_path, capsys, FIXTURES / "pilot.toml")
    assert rc == 0, err
    assert f"--config-dir {tmp_path / 'conf'} --multirun +campaign=pilot" in out
    cfg = composed(tmp_path / "conf", "+campaign=pilot")
    assert dict(cfg.hydra.sweeper.params) == {
        "algorithm": "grpo_none,maxrl_gtpo_sepa",
        "training.seed": "42,101,202,303",
    }
    assert cfg.hydra.launcher._target_.endswith("LocalLauncher")  # parallel = true
    assert_values(
        cfg,
        {
            "training.max_steps": 50,  # [campaign] max_steps wins over [training], as in the original retrain
            "training.batch_size": 8,
            "model.lora_rank": 64,
            "squeeze.min_variance_retention": 0.9,
            "logging.wandb_project": "sepa-pilot",
            "logging.wandb_group": cfg.algorithm.name,
        },
    )
    assert "[campaign] max_workers = 4" in out and '[logging] log_dir = "logs/pilot"' in out


def test_campaign_defaults_are_the_original_five_conditions_and_eight_seeds(tmp_path, capsys):
    assert migrate(tmp_path, capsys, "[campaign]\n")[0] == 0
    params = composed(tmp_path / "conf", "+campaign=old").hydra.sweeper.params
    assert params.algorithm == "grpo_none,maxrl_none,maxrl_gtpo,maxrl_gtpo_hicra,maxrl_gtpo_sepa"
    assert params["training.seed"] == "42,101,202,303,404,505,606,707"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[training]\nlrr = 1e-4\n[foo]\nx = 1\n",
            "unknown keys, not part of the original TOML format: [training] lrr, [foo]",
        ),
        ('[algorithm]\ntransform_mode = "gtpo_foo"\n', "transform_mode = 'gtpo_foo': not a transform mode"),
        ('[reward]\ntype = "bogus"\n', "[reward] type = 'bogus': not a reward type"),
        ('[inference]\nengine = "tgi"\n', "[inference] engine = 'tgi': not an engine"),
        (
            '[campaign]\n[[campaign.conditions]]\nadvantage_mode = "grpo"\ntransform_mode = "none"\nlr = 1e-5\n',
            "per-condition overrides (lr) cannot be migrated",
        ),
        ("[training\n", "not a readable TOML file"),
        ("x = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deep to parse"),
        ("x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n", "nested too deep to parse"),
        ("[training]\nx = " + "[" * 40 + "]" * 40 + "\n", "training.x" + "[0]" * 31 + " nests arrays or tables deeper"),
    ],
)
def test_bad_input_is_an_error_naming_the_key(tmp_path, capsys, toml, message):
    rc, _, err = migrate(tmp_path, capsys, toml)
    assert rc == 1
    assert message in err
    assert not (tmp_path / "conf").exists()


def test_check_exits_1_for_a_toml_and_0_for_a_preset(tmp_path, capsys):
    rc, out, _ = migrate(tmp_path, capsys, FIXTURES / "mini.toml", "--check")
    assert rc == 1 and "needs migrating" in out and "is missing" in out
    assert not (tmp_path / "conf").exists()  # --check writes nothing
    assert migrate(tmp_path, capsys, FIXTURES / "mini.toml")[0] == 0
    rc, out, _ = migrate(tmp_path, capsys, FIXTURES / "mini.toml", "--check")
    assert rc == 1 and "is up to date" in out  # the TOML itself is still a TOML
    assert migrate(tmp_path, capsys, tmp_path / "conf" / "experiment" / "mini.yaml", "--check")[0] == 0


def test_stdout_prints_the_preset_and_writes_nothing(tmp_path, capsys):
    rc, out, err = migrate(tmp_path, capsys, FIXTURES / "mini.toml", "--stdout")
    assert rc == 0
    assert out.startswith("# @package _global_\n")
    assert yaml.safe_load(out)["training"]["max_steps"] == 20
    assert "adapter_path" in err  # the report goes to stderr, stdout stays YAML
    assert not (tmp_path / "conf").exists()


def test_a_different_preset_is_not_overwritten_without_force(tmp_path, capsys):
    shutil.copy(FIXTURES / "mini.toml", tmp_path / "mini.toml")
    assert migrate(tmp_path, capsys, tmp_path / "mini.toml")[0] == 0
    assert migrate(tmp_path, capsys, tmp_path / "mini.toml")[0] == 0  # the same text again: fine
    (tmp_path / "mini.toml").write_text(
        (FIXTURES / "mini.toml").read_text().replace("max_steps = 20", "max_steps = 30")
    )
    rc, _, err = migrate(tmp_path, capsys, tmp_path / "mini.toml")
    assert rc == 1 and "--force" in err
    assert migrate(tmp_path, capsys, tmp_path / "mini.toml", "--force")[0] == 0
    assert composed(tmp_path / "conf", "experiment=mini").training.max_steps == 30


def test_the_semantic_planning_detector_and_its_model_carry_over(tmp_path, capsys):
    rc, out, err = migrate(
        tmp_path,
        capsys,
        """
        [model]
        model = "retrain:tiny_qwen3"
        [planning]
        detector = "semantic"
        model = "all-MiniLM-L6-v2"
        threshold = 0.02
        """,
    )
    assert rc == 0, err
    cfg = composed(tmp_path / "conf", "experiment=old")
    assert_values(cfg, {"algorithm.planning.detector": "semantic", "algorithm.planning.model": "all-MiniLM-L6-v2"})
    assert cfg.algorithm.planning.threshold == 0.6  # the seeds' 0.02 is on another scale: reported, not carried
    assert "[planning] threshold = 0.02" in out and "cosine similarity" in out


def test_a_fifo_is_refused_not_read(tmp_path, capsys):
    fifo = tmp_path / "old.toml"
    os.mkfifo(fifo)
    assert main([str(fifo), "--output-dir", str(tmp_path / "conf")]) == 1  # reading it would block forever
    assert (
        capsys.readouterr().err
        == f"retrain migrate-config: {fifo}: not a regular file (a FIFO, socket or device); give a .toml file\n"
    )
