"""backend=prime_rl: each step's rows go to an external PRIME-RL trainer; its broadcasts come back as the new weights.

`train(batch)` packs the kept rows (each token with its own advantage) into PRIME-RL micro-batches, sends
them as step N through the configured transport, and waits for the trainer's broadcast of step N
(weights.py); that directory is the step's WeightUpdate, which the engine (engine.py) has the
PRIME-RL inference server load. The optimizer, its settings and the loss run inside PRIME-RL (its
trainer config), asynchronously: the loss reported here is a placeholder 0.0
(`reports_sync_loss=False`, annotated on the console line). Steps are numbered as PRIME-RL numbers
them: a fresh PRIME-RL trainer reads rollouts/step_1 first, so weights version N is step N.
A checkpoint records the step and its broadcast (prime_rl_state.json); resuming needs the PRIME-RL
trainer resumed from its own checkpoint of that step, whose startup broadcast the load waits for.

msgspec and pyzmq (`retrain[prime_rl]`) are imported when the backend is built, so this module
imports without them (`retrain backends` lists it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from retrain.backend.base import Capabilities
from retrain.backend.prime_rl.config import PrimeRlBackendConfig
from retrain.backend.prime_rl.transport import FilesystemSender, RolloutSender, ZmqSender
from retrain.backend.prime_rl.weights import BroadcastModel, broadcast_dir, wait_for_broadcast
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.errors import ConfigError
from retrain.inference.base import InferenceEngine
from retrain.inference.config import check_url
from retrain.model.probe import PROBE_TOLERANCE_HALF, Probe
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import TrainBatch, TrainResult, WeightUpdate

log = logging.getLogger(__name__)

STATE_FILE = "prime_rl_state.json"


@built_in
@takes_settings(PrimeRlBackendConfig)
class PrimeRlBackend:
    """Satisfies retrain.backend.base.Backend; see the module docstring."""

    capabilities = Capabilities(
        reports_sync_loss=False,
        preserves_token_advantages=True,  # its loss takes advantages per token (packing.py)
        supports_checkpoint_resume=True,
        resume_runtime_dependent=False,
        samples_itself=True,
    )
    checkpoint_files = (STATE_FILE,)
    # the server samples in bf16 as a rule, the probe's reference in model.dtype on the CPU
    probe_tolerance = PROBE_TOLERANCE_HALF

    def __init__(
        self, config: PrimeRlBackendConfig, model: ModelSpec, optim: OptimSettings, loss: LossSettings, seed: int
    ) -> None:
        _require_extra("msgspec", *(["zmq"] if config.transport == "zmq" else []))
        self.spec = model
        self.output_dir = Path(config.output_dir).expanduser()
        self.inference_url = check_url(config.inference_url, "backend.inference_url")
        self.sync_wait_s = config.sync_wait_s
        self.sync_poll_s = config.sync_poll_s
        self.seq_len = config.seq_len
        self.num_train_workers = config.num_train_workers
        log.info(
            "backend=prime_rl: optimizer, learning rate and loss are the PRIME-RL trainer's own settings; "
            "training.lr=%s and the training.clip_* values are not sent",
            optim.lr,
        )
        self.sender: RolloutSender = (
            ZmqSender(config.zmq_host, config.zmq_port, config.zmq_hwm, config.num_train_workers, config.sync_wait_s)
            if config.transport == "zmq"
            else FilesystemSender(self.output_dir)
        )
        self.step = 0  # the last step PRIME-RL trained and broadcast (= weights version)
        self.broadcast: Path | None = None  # its broadcast (None: the base weights, before any step)
        self.reference = BroadcastModel(model)

    def engine_resources(self) -> EngineResources:
        return EngineResources(spec=self.spec, device=torch.device("cpu"))

    def sampling_engine(self, tokenizer: Any) -> InferenceEngine:
        from retrain.backend.prime_rl.engine import PrimeRlEngine

        return PrimeRlEngine(tokenizer, self.spec, self.inference_url)

    def train(self, batch: TrainBatch) -> TrainResult:
        from retrain.backend.prime_rl.messages import encode_rank
        from retrain.backend.prime_rl.packing import pack, row_samples, trained_tokens

        samples = row_samples(batch)
        if not samples:
            return TrainResult(loss=0.0, grad_norm=0.0, skipped_nonfinite=False, num_tokens=0)
        grid = pack(samples, self.seq_len, self.num_train_workers)
        step = self.step + 1
        self.sender.send(step, [encode_rank(micro_batches) for micro_batches in grid])
        directory = wait_for_broadcast(broadcast_dir(self.output_dir, step), self.sync_wait_s, self.sync_poll_s)
        self.step, self.broadcast = step, directory
        return TrainResult(
            loss=0.0,  # placeholder: PRIME-RL computes the loss in its own process
            grad_norm=0.0,
            skipped_nonfinite=False,
            num_tokens=trained_tokens(samples),
            metrics={"prime_rl/samples": float(len(samples)), "prime_rl/micro_batches": float(len(grid[0]))},
            update=WeightUpdate(version=step, adapter_dir=directory),
        )

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        return self.reference.probe_logprobs(probe, self.broadcast)

    def save(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "broadcast_dir": None if self.broadcast is None else str(self.broadcast),
            "output_dir": str(self.output_dir),
        }
        partial = path / f"{STATE_FILE}.tmp"
        partial.write_text(json.dumps(state, indent=2))
        os.replace(partial, path / STATE_FILE)

    def load(self, path: Path) -> WeightUpdate:
        state = json.loads((Path(path) / STATE_FILE).read_text())
        if Path(state["output_dir"]) != self.output_dir:
            raise ConfigError(
                f"backend.output_dir={str(self.output_dir)!r}, but the checkpoint in {path} was trained through "
                f"{state['output_dir']!r}; resume with the same PRIME-RL output_dir"
            )
        step = int(state["step"])
        # a (resumed) PRIME-RL trainer broadcasts its incoming weights as that step at start: wait for them
        directory = wait_for_broadcast(broadcast_dir(self.output_dir, step), self.sync_wait_s, self.sync_poll_s)
        self.step, self.broadcast = step, directory
        return WeightUpdate(version=step, adapter_dir=directory)

    def close(self) -> None:
        self.sender.close()


def _require_extra(*modules: str) -> None:
    import importlib.util

    missing = [module for module in modules if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"backend=prime_rl needs {', '.join(missing)}: pip install 'retrain[prime_rl]'")
