"""backend=tinker: a LoRA adapter trained on the Tinker service, which also samples with it.

The ServiceClient talks to `backend.base_url` (else $TINKER_BASE_URL, else the SDK's endpoint) with
the key in $TINKER_API_KEY, read from the environment only. One LoRA training client (the model's
Hub id, `model.lora_rank`, the run's seed) trains; each step sends its datums (retrain/backend/
tinker/datums.py) with forward_backward and the AdamW step with optim_step, both submitted before
either is awaited, then publishes the new weights as sampler weights `policy-v{N}` for the engine
(retrain/backend/tinker/sampler.py) to open. The freshness proof compares two real paths: the
sampler's log-prob computation against this training client's forward.

A checkpoint is the service's own (`save_state`, optimizer included); the checkpoint dir records
its `tinker://` path, and `load` resumes exactly with a training client created from that state and
its optimizer moments. Resuming therefore depends on the service still holding the state
(`resume_runtime_dependent`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch

from retrain.backend.base import Capabilities
from retrain.backend.settings import LossSettings, OptimSettings
from retrain.backend.tinker.calls import (
    API_KEY_ENV,
    BASE_URL_ENV,
    RemoteCalls,
    TinkerServiceError,
    load_sdk,
    refused_as_invalid,
)
from retrain.backend.tinker.config import TinkerBackendConfig
from retrain.backend.tinker.datums import loss_function, ratio_metrics, step_datums
from retrain.backend.tinker.limiter import FileSemaphore, default_lock_dir
from retrain.backend.tinker.sampler import TinkerSampler
from retrain.errors import CheckpointError, ConfigError, UserError
from retrain.inference.adapters import adapter_name
from retrain.model.probe import PROBE_TOLERANCE_HALF, Probe
from retrain.model.resources import EngineResources
from retrain.model.spec import ModelSpec
from retrain.plugins import built_in
from retrain.settings_object import takes_settings
from retrain.types import TrainBatch, TrainResult, WeightUpdate

log = logging.getLogger(__name__)

T = TypeVar("T")

STATE_FILE = "tinker_state.json"
KEY_PREFIXES = ("tml-", "eyJ")  # what the SDK accepts: an API key, or a JWT credential
REACH_TIMEOUT_S = 10.0  # a TCP connect to the service's URL at start
ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})
UNEMBED_MODULES = frozenset({"lm_head"})


class TinkerNonFiniteLossError(UserError, RuntimeError):
    """The service reported a non-finite loss for a step whose optimizer update it had already applied."""


def api_key_from_env() -> str:
    """The key in $TINKER_API_KEY (the only place it is read from); ConfigError naming it when unset or malformed."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        raise ConfigError(
            f"backend=tinker reads its API key from the environment variable {API_KEY_ENV}, which is not set "
            f"(export {API_KEY_ENV}=tml-...; the key is never read from the config)"
        )
    if not key.startswith(KEY_PREFIXES):
        raise ConfigError(f"{API_KEY_ENV} does not hold a Tinker API key (those start with 'tml-')")
    return key


def lora_layers(model: ModelSpec) -> dict[str, bool]:
    """`model.target_modules` as the service's LoRA switches (attention, MLP, unembedding)."""
    modules = set(model.target_modules)
    layers = {
        "train_attn": bool(modules & ATTENTION_MODULES),
        "train_mlp": bool(modules & MLP_MODULES),
        "train_unembed": bool(modules & UNEMBED_MODULES),
    }
    if not any(layers.values()):
        raise ConfigError(
            f"model.target_modules={model.target_modules}: backend=tinker adapts attention "
            f"({', '.join(sorted(ATTENTION_MODULES))}), MLP ({', '.join(sorted(MLP_MODULES))}) or lm_head layers"
        )
    return layers


def check_reachable(url: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Fail in seconds when nothing listens at the service's URL: the SDK retries a refused connection for minutes."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname or "", port), timeout=timeout_s).close()
    except OSError as error:
        raise TinkerServiceError(
            f"cannot reach the Tinker service at {url} (backend.base_url or {BASE_URL_ENV}): {error}"
        ) from error


@built_in
@takes_settings(TinkerBackendConfig)
class TinkerBackend:
    """Satisfies retrain.backend.base.Backend; see the module docstring."""

    capabilities = Capabilities(
        reports_sync_loss=True,
        preserves_token_advantages=True,
        supports_checkpoint_resume=True,
        resume_runtime_dependent=True,
        samples_itself=True,
    )
    checkpoint_files = (STATE_FILE,)
    # The sampler and the trainer are two different bf16 stacks on the service (an inference engine and a
    # training forward); their log-probs of the same tokens differ by bf16 rounding, ~1e-2 per token. The
    # half-precision tolerance the local engines use leaves room for that, and the proof's second test (the
    # sampler must sit far closer to the new weights than to the old) still catches a stale sampler whose
    # update moved the probe by less than the tolerance.
    probe_tolerance = PROBE_TOLERANCE_HALF

    def __init__(
        self, config: TinkerBackendConfig, model: ModelSpec, optim: OptimSettings, loss: LossSettings, seed: int
    ) -> None:
        layers = lora_layers(model)
        self.sdk = load_sdk()
        api_key = api_key_from_env()
        self.spec = model
        self.optim_settings = optim
        self.loss_settings = loss
        self.loss_name, self.loss_config = loss_function(loss)
        self.sampler_ttl_s = config.sampler_ttl_s or None
        lock_dir = Path(config.lock_dir).expanduser() if config.lock_dir else default_lock_dir()
        slots = FileSemaphore(lock_dir, config.max_concurrent_calls)
        self.calls = RemoteCalls(self.sdk, slots, config.max_retries, config.retry_backoff_s, api_key)
        self.base_url = config.base_url or os.environ.get(BASE_URL_ENV) or None
        if self.base_url is not None:
            check_reachable(self.base_url)
        self.service = self.sdk.ServiceClient(base_url=self.base_url, api_key=api_key)
        log.info(
            "Connecting to Tinker (%s) for %s, LoRA rank %d...",
            self.base_url or "the SDK's default endpoint",
            model.name_or_path,
            model.lora_rank,
        )
        self.training = self._create(
            f"creating a LoRA training client for {model.name_or_path}",
            lambda: self.service.create_lora_training_client(
                base_model=model.name_or_path, rank=model.lora_rank, seed=seed, **layers
            ).result(),
            refused=lambda error: ConfigError(
                f"model.name_or_path={model.name_or_path!r}: the Tinker service does not train this model "
                f"with LoRA rank {model.lora_rank} ({error})"
            ),
        )
        self.weights_version = 0
        self._warned_temperature = False
        log.info("TinkerBackend ready (lora_alpha, lora_dropout and dtype are the service's own).")

    # ---- what the composition root and the trainer ask ---------------------------------------
    def engine_resources(self) -> EngineResources:
        return EngineResources(spec=self.spec, device=torch.device("cpu"))

    def sampling_engine(self, tokenizer: Any) -> TinkerSampler:
        """The run's inference engine: a sampling client of the current weights."""
        return TinkerSampler(self.service, self.calls, tokenizer, self._publish())

    def train(self, batch: TrainBatch) -> TrainResult:
        temperature = batch.rollouts.temperature
        if temperature <= 0:
            raise ValueError("greedy rollouts (temperature 0) have no sampling distribution to train on")
        if temperature != 1.0 and not self._warned_temperature:
            self._warned_temperature = True
            log.warning(
                "training.temperature=%s: Tinker's training forward scores tokens at temperature 1, so the importance "
                "ratio also corrects for the temperature the sampler used (training.temperature=1 keeps it on-policy)",
                temperature,
            )
        step = step_datums(self.sdk, batch)
        if step.num_tokens == 0:
            return TrainResult(loss=0.0, grad_norm=0.0, skipped_nonfinite=False, num_tokens=0)
        optim = self.optim_settings
        adam = self.sdk.AdamParams(
            learning_rate=optim.lr,
            beta1=optim.betas[0],
            beta2=optim.betas[1],
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            grad_clip_norm=optim.max_grad_norm,
        )
        training = self.training

        def step_call() -> tuple[Any, Any]:
            backward = training.forward_backward(step.datums, self.loss_name, self.loss_config)
            update = training.optim_step(adam)  # submitted before either result is awaited: one round trip
            return backward.result(), update.result()

        # a step is not idempotent (gradients accumulate on the service), so it is never re-sent here
        backward, update = self.calls.run("training a step", step_call, retry=False)
        self.weights_version += 1
        loss_value = float(backward.metrics["loss:sum"])
        if not math.isfinite(loss_value):
            raise TinkerNonFiniteLossError(
                f"Tinker reported loss={loss_value} for the step to weights version {self.weights_version}, after "
                "applying its optimizer update (the two are submitted together); resume from the last checkpoint, "
                "e.g. with a lower training.lr"
            )
        metrics = ratio_metrics(step, backward.loss_fn_outputs, self.loss_settings)
        return TrainResult(
            loss=loss_value,
            grad_norm=_grad_norm(backward.metrics, update.metrics),
            skipped_nonfinite=False,
            num_tokens=step.num_tokens,
            metrics=metrics,
            update=self._publish(),
        )

    def probe_logprobs(self, probe: Probe) -> torch.Tensor:
        """The training client's forward: cross-entropy log-probs of the probe's continuation."""
        tokens = probe.prompt_ids + probe.completion_ids
        count = len(probe.completion_ids)
        weights = [0.0] * (len(probe.prompt_ids) - 1) + [1.0] * count
        datum = self.sdk.Datum(
            model_input=self.sdk.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": self.sdk.TensorData.from_torch(torch.tensor(tokens[1:], dtype=torch.int64)),
                "weights": self.sdk.TensorData.from_torch(torch.tensor(weights, dtype=torch.float32)),
            },
        )
        training = self.training
        output = self.calls.run(
            "scoring the freshness probe on the trainer", lambda: training.forward([datum], "cross_entropy").result()
        )
        return output.loss_fn_outputs[0]["logprobs"].to_torch().float()[-count:]

    def save(self, path: Path) -> None:
        """The service saves weights and optimizer state; `path` records where (written into the
        checkpoint's staging dir, which the run dir renames into place whole)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        training, version = self.training, self.weights_version
        saved = self.calls.run(
            f"saving the state of weights version {version}",
            lambda: training.save_state(name=f"retrain-v{version}", overwrite=True).result(),
        )
        state = {
            "tinker_path": saved.path,
            "weights_version": version,
            "base_model": self.spec.name_or_path,
            "lora_rank": self.spec.lora_rank,
        }
        (path / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))

    def load(self, path: Path) -> WeightUpdate:
        path = Path(path)
        try:
            state = json.loads((path / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise CheckpointError(f"checkpoint {path}: {STATE_FILE} cannot be read ({error})") from error
        expected = {"base_model": self.spec.name_or_path, "lora_rank": self.spec.lora_rank}
        mismatched = {key: (state.get(key), value) for key, value in expected.items() if state.get(key) != value}
        if mismatched:
            details = ", ".join(
                f"{key}: checkpoint {old!r} vs config {new!r}" for key, (old, new) in mismatched.items()
            )
            raise ConfigError(f"checkpoint {path} does not match model.name_or_path/model.lora_rank ({details})")
        remote = str(state["tinker_path"])
        self.training = self._create(
            f"restoring {remote} with its optimizer state",
            lambda: self.service.create_training_client_from_state_with_optimizer(remote).result(),
            refused=lambda error: CheckpointError(
                f"checkpoint {path}: the Tinker service cannot restore {remote} (expired or deleted?): {error}"
            ),
        )
        self.weights_version = int(state["weights_version"])
        return self._publish()

    def close(self) -> None:
        self.calls.close()
        try:
            self.service.close("success").result()
        except self.sdk.TinkerError as error:  # the run's outcome is decided; a session left open times out
            log.warning("Tinker session did not close cleanly: %s", error)

    # ---- helpers -----------------------------------------------------------------------------
    def _publish(self) -> WeightUpdate:
        """Save the current weights for sampling as `policy-v{N}`; the update names their path."""
        training, version = self.training, self.weights_version
        saved = self.calls.run(
            f"saving sampler weights {adapter_name(version)}",
            lambda: training.save_weights_for_sampler(
                name=adapter_name(version), ttl_seconds=self.sampler_ttl_s
            ).result(),
        )
        return WeightUpdate(version=version, remote=saved.path)

    def _create(self, what: str, call: Callable[[], T], refused: Callable[[str], UserError]) -> T:
        """A create call; a request the service finds invalid becomes `refused`'s error (what to fix)."""
        try:
            return self.calls.run(what, call)
        except TinkerServiceError as error:
            if error.__cause__ is not None and refused_as_invalid(error.__cause__):
                raise refused(str(error.__cause__)) from error
            raise


def _grad_norm(*reported: dict[str, float] | None) -> float:
    """The gradient norm where the service reports one (a metric named grad_norm...), else 0.0."""
    for metrics in reported:
        for key, value in (metrics or {}).items():
            if key.startswith("grad_norm") and math.isfinite(value):
                return float(value)
    return 0.0
