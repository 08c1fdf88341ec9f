"""The weights PRIME-RL's trainer broadcasts after every step, and the trainer-side copy that proves freshness.

Layout (PRIME-RL v0.8.1.dev67, commit 559b44772e471d1538537b8805cc77f3824a5e64,
src/prime_rl/transports/weights/filesystem.py): after step N the trainer writes
`<output_dir>/broadcasts/step_N/` — a PEFT adapter (adapter_model.safetensors + adapter_config.json)
when it trains LoRA, else the full model as HF safetensors — and then touches `STABLE` in it; only a
directory with `STABLE` is complete. On start (and on resume from checkpoint N) it broadcasts its
incoming policy as step 0 (step N) before it reads any rollouts.

The freshness proof needs the trainer's log-probs under those weights, but the PRIME-RL trainer
exposes no scoring route. `BroadcastModel` is therefore a CPU copy of the base model (model.*, in
model.dtype) into which each probed broadcast is loaded; it scores the probe exactly as a local
backend would. Cost: the base model's weights in this process's memory (fp32 on CPU unless
model.dtype says otherwise), and reading each probed broadcast (an adapter: small; full weights: the
whole model, every step). It is loaded at the first probe and never touches the GPU.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from retrain.errors import UserError
from retrain.model.peft_files import ADAPTER_CONFIG
from retrain.model.probe import Probe
from retrain.model.spec import ModelSpec

log = logging.getLogger(__name__)

STABLE = "STABLE"


def broadcast_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "broadcasts" / f"step_{step}"


def is_adapter(directory: Path) -> bool:
    """Whether a broadcast holds a LoRA adapter (else full weights)."""
    return (directory / ADAPTER_CONFIG).is_file()


def wait_for_broadcast(directory: Path, wait_s: float, poll_s: float) -> Path:
    """`directory` once its STABLE marker exists, checked every `poll_s` for up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while not (directory / STABLE).exists():
        if time.monotonic() >= deadline:
            raise UserError(
                f"backend=prime_rl: no complete PRIME-RL broadcast at {directory} ({STABLE} did not appear within "
                f"backend.sync_wait_s={wait_s:g} s). Is the PRIME-RL trainer running with output_dir="
                f"{directory.parent.parent}, weight_broadcast.type=filesystem and the same rollout transport? "
                "Raise backend.sync_wait_s when its steps take longer."
            )
        time.sleep(poll_s)
    return directory


class BroadcastModel:
    """A CPU copy of the model holding a broadcast's weights (see the module docstring)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.model: Any = None  # the base model, wrapped in PEFT once an adapter broadcast is loaded
        self.loaded: Path | None = None  # the broadcast it holds (None: the base weights)

    def probe_logprobs(self, probe: Probe, directory: Path | None) -> torch.Tensor:
        """[K] log-probs at T = 1 of the probe's completion under the weights of `directory` (None: the base model)."""
        from retrain.model.logprobs import completion_logprobs

        model = self._holding(directory)
        prompt = torch.tensor([probe.prompt_ids])
        completion = torch.tensor([probe.completion_ids])
        with torch.inference_mode():
            logprobs = completion_logprobs(
                model,
                prompt,
                torch.ones_like(prompt, dtype=torch.bool),
                torch.zeros(1, dtype=torch.long),
                completion,
                torch.ones_like(completion, dtype=torch.bool),
                1.0,
                share_prompts=False,
            )
        return logprobs[0]

    def _holding(self, directory: Path | None) -> Any:
        if self.model is not None and directory == self.loaded:
            return self.model
        if directory is None or not is_adapter(directory) or self.model is None:
            self.model = self._base()  # full weights replace everything; the base model needs a clean copy
        if directory is not None:
            self._load(directory)
        self.loaded = directory
        return self.model

    def _base(self) -> Any:
        from transformers import AutoModelForCausalLM

        path, _ = self.spec.source()
        log.info("Loading a CPU copy of %s to score the freshness probe under PRIME-RL's broadcasts", path)
        dtype = self.spec.torch_dtype(torch.device("cpu"))
        return AutoModelForCausalLM.from_pretrained(path, revision=self.spec.revision, dtype=dtype).eval()

    def _load(self, directory: Path) -> None:
        if is_adapter(directory):
            self._load_adapter(directory)
        else:
            self._load_full(directory)

    def _load_adapter(self, directory: Path) -> None:
        from peft import PeftModel, set_peft_model_state_dict
        from peft.utils import load_peft_weights

        if not isinstance(self.model, PeftModel):
            self.model = PeftModel.from_pretrained(self.model, str(directory)).eval()
            return
        result: Any = set_peft_model_state_dict(self.model, load_peft_weights(str(directory), device="cpu"))
        missing = [key for key in result.missing_keys if "lora_" in key]
        if result.unexpected_keys or missing:
            raise UserError(
                f"the PRIME-RL adapter in {directory} does not fit model.name_or_path={self.spec.name_or_path!r}: "
                f"unexpected weights {result.unexpected_keys[:5]}, missing LoRA weights {missing[:5]}"
            )

    def _load_full(self, directory: Path) -> None:
        from safetensors.torch import load_file

        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"the PRIME-RL broadcast {directory} holds neither an adapter nor *.safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file), device="cpu"))
        result = self.model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise UserError(
                f"the PRIME-RL weights in {directory} do not fit model.name_or_path={self.spec.name_or_path!r}: "
                f"unexpected weights {result.unexpected_keys[:5]}"
            )
