"""Every file a real run writes, its checkpoints and final/ and an `export --merged` among them, has the mode
any new file gets under the umask (safetensors creates its files 0600 by itself)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from retrain.housekeeping.file_modes import current_umask
from retrain.inference.adapters import AdapterPublisher
from retrain.model.peft_files import ADAPTER_WEIGHTS
from retrain.model.spec import ModelSpec
from retrain.types import WeightUpdate
from tests.backend.tiny_model import make_backend
from tests.conftest import CliHere


def modes(root: Path) -> dict[str, str]:
    """The permission bits of every file and dir under `root`, by path relative to it."""
    return {
        path.relative_to(root).as_posix(): oct(stat.S_IMODE(path.lstat().st_mode))
        for path in [root, *root.rglob("*")]
        if not path.is_symlink()
    }


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_run_and_its_merged_export_follow_the_umask(tmp_path: Path, umask: int, cli_here: CliHere) -> None:
    run_dir, merged = tmp_path / "run", tmp_path / "merged"
    overrides = ["training.max_steps=2", "training.save_every=1", "eval.num_examples=0", "logging.progress_bar=false"]
    previous = os.umask(umask)  # the commands, run in this process, create their files under it
    try:
        cli_here(["experiment=quickstart", *overrides, f"hydra.run.dir={run_dir}"], tmp_path)
        cli_here(["export", str(run_dir), "--merged", str(merged)], tmp_path)
    finally:
        os.umask(previous)
    found = modes(tmp_path)
    assert {"run/checkpoints/step_1/adapter_model.safetensors", "run/final/adapter_model.safetensors"} <= set(found)
    assert any(name.startswith("merged/") and name.endswith(".safetensors") for name in found)
    expected = {name: oct((0o777 if (tmp_path / name).is_dir() else 0o666) & ~umask) for name in found}
    expected["."] = found["."]  # pytest's tmp_path, made before the umask was set
    assert found == expected


def test_an_adapter_published_for_an_inference_server_follows_the_umask(tmp_path: Path) -> None:
    """The server reading it may run as another user of the group (inference.adapter_root)."""
    spec = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)
    update = WeightUpdate(version=1, tensors=make_backend(spec).adapter)
    published = AdapterPublisher(spec, tmp_path / "adapters").publish(update)
    found, mask = modes(published), current_umask()
    assert (published / ADAPTER_WEIGHTS).is_file()
    assert found == {name: oct((0o777 if (published / name).is_dir() else 0o666) & ~mask) for name in found}
