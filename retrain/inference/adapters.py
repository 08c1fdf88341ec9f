"""Versioned adapter directories: how an engine that loads LoRA files (vLLM, SGLang) gets new weights.

Every optimizer step's adapter is written to a new directory `policy-v{N}` and served under that
name; a directory is never overwritten in place. Engines cache adapters by name or id, so reusing
either silently serves the old weights (measured with vLLM: a reused `lora_int_id` with a new path
keeps the old adapter). Directories are written to a temp name and renamed, so an engine never
reads a half-written adapter, and all but the newest few are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from retrain.errors import ConfigError
from retrain.housekeeping.file_modes import follow_umask
from retrain.model.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from retrain.types import WeightUpdate

PEFT_ADAPTER_NAME = "default"  # the name PEFT gives a model's only adapter; absent from saved keys


def adapter_name(version: int, tag: str = "") -> str:
    """The name an engine serves weights version `version` under (`tag`: a rank's, see rank_tag)."""
    return f"policy-v{version}{tag}"


def rank_tag() -> str:
    """`-r<rank>` on a rank of a data-parallel run, else '': ranks that share inference servers (and
    inference.adapter_root) each load their own copy of a version, so none unloads or overwrites another's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f"-r{dist.get_rank()}"
    return ""


def peft_adapter_config(spec: ModelSpec, base_model: str) -> dict[str, object]:
    """The adapter_config.json PEFT would write for `spec`'s LoRA (what vLLM and SGLang read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.lora_rank,
        "lora_alpha": spec.effective_alpha,
        "lora_dropout": spec.lora_dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def peft_saved_key(parameter_name: str) -> str:
    """A live PEFT parameter name (`…q_proj.lora_A.default.weight`) as PEFT saves it (`…q_proj.lora_A.weight`)."""
    return parameter_name.replace(f".{PEFT_ADAPTER_NAME}.", ".")


def initial_update(resources: EngineResources) -> WeightUpdate | None:
    """Weights version 0 (the backend's freshly initialised adapter), when the backend shares its model."""
    if resources.model is None:
        return None
    tensors = {name: p for name, p in resources.model.named_parameters() if p.requires_grad}
    return WeightUpdate(version=0, tensors=tensors)


class AdapterPublisher:
    """Writes each WeightUpdate to its own `policy-v{N}` directory under `root` (a temp dir by default)."""

    def __init__(self, spec: ModelSpec, root: Path | None = None, keep: int = 2, tag: str = "") -> None:
        self.spec = spec
        self.tag = tag  # appended to each directory's name (adapter_name)
        self.base_model = spec.source()[0]
        self._owned_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="retrain-adapters-")) if root is None else Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # a file in its place, a path without write permission
            raise ConfigError(f"inference.adapter_root={str(root)!r}: cannot be a directory: {error}") from error
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"inference.adapter_root={str(root)!r}: this process cannot write into it")
        self.keep = keep
        self._published: list[Path] = []

    def publish(self, update: WeightUpdate) -> Path:
        """The directory holding `update`'s adapter in PEFT format, written once and never changed."""
        target = self.root / adapter_name(update.version, self.tag)
        if target.exists():
            shutil.rmtree(target)  # a resumed run re-publishes a version; never serve a stale copy of it
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=self.root))
        if update.adapter_dir is not None:
            shutil.copytree(update.adapter_dir, staging, dirs_exist_ok=True)
        else:
            assert update.tensors is not None
            self._write(update.tensors, staging)
        follow_umask(staging)  # an engine running as another user of the group reads it
        staging.rename(target)
        self._published.append(target)
        for old in self._published[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        self._published = self._published[-self.keep :]
        return target

    def _write(self, tensors: Mapping[str, torch.Tensor], directory: Path) -> None:
        weights = {
            peft_saved_key(name): tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in tensors.items()
        }
        save_file(weights, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = peft_adapter_config(self.spec, self.base_model)
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))

    def close(self) -> None:
        """Remove the directories this publisher wrote (the whole root when it made it)."""
        if self._owned_root:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            for path in self._published:
                shutil.rmtree(path, ignore_errors=True)
        self._published = []
