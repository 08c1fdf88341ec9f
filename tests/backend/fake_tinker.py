"""A fake of the Tinker SDK's client objects for tests (the SDK has no local mode).

`fake_sdk(service)` is a stand-in for the `tinker` module: the real SDK's data types (Datum,
ModelInput, TensorData, SamplingParams, AdamParams, SampleResponse, ...) and exceptions, with its
ServiceClient, TrainingClient and SamplingClient replaced by fakes that have the SDK's method names,
arguments and return shapes (taken from tinker 0.38's sources). Behind them, `FakeService` keeps a
toy policy per training run, real enough to learn: next-token logits are a fixed random bigram table
plus a trainable LoRA-style low-rank term (B starts at zero, as LoRA's does), trained with the
service's documented losses (`importance_sampling`, `ppo`, `cross_entropy`, sums over tokens) and a
real AdamW. Saved states and sampler weights live in the service's storage under `tinker://` paths,
so a new ServiceClient (a resumed run) finds them. Every call is recorded in `FakeService.events`.
"""

from __future__ import annotations

import copy
import itertools
import types
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the fake reuses the SDK's types: pip install 'retrain[tinker]'")

LORA_RANK_CAP = 8  # the toy's low-rank term is at most this wide whatever rank is asked


def status_error(cls: type[tinker.APIStatusError], code: int, message: str) -> tinker.APIStatusError:
    """An SDK status error as the SDK raises it (with the HTTP response it came from)."""
    response = httpx.Response(code, request=httpx.Request("POST", "http://fake-tinker/api/v1"))
    return cls(message, response=response, body=None)


class FakeFuture:
    """The SDK's APIFuture: the request is done when submitted; `result()` is when the caller waits."""

    def __init__(self, service: FakeService, name: str, value: Any = None, error: BaseException | None = None) -> None:
        self.service, self.name, self.value, self.error = service, name, value, error

    def result(self, timeout: float | None = None) -> Any:
        self.service.events.append(("result", self.name))
        if self.error is not None:
            raise self.error
        return self.value


@dataclass
class Policy:
    """The toy model's trainable part and its AdamW state."""

    lora_a: torch.Tensor  # [V, r] fixed random (LoRA's A)
    lora_b: torch.Tensor  # [r, V] trainable, starts at 0
    optimizer_state: dict[str, Any] = field(default_factory=dict)

    def copy(self) -> Policy:
        return Policy(self.lora_a.clone(), self.lora_b.detach().clone(), copy.deepcopy(self.optimizer_state))


@dataclass
class FakeService:
    """What the fake clients talk to: models it serves, accepted keys, storage, injected failures, events."""

    models: dict[str, int] = field(
        default_factory=lambda: {"retrain:tiny_qwen3": 260, "Qwen/Qwen3-4B-Instruct-2507": 260}
    )
    api_keys: set[str] = field(default_factory=lambda: {"tml-fake-key"})
    storage: dict[str, tuple[str, Policy]] = field(default_factory=dict)  # tinker path -> (base model, weights)
    events: list[tuple[str, str]] = field(default_factory=list)
    requests: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    failures: dict[str, list[BaseException]] = field(default_factory=lambda: defaultdict(list))
    runs: itertools.count = field(default_factory=itertools.count)
    base_tables: dict[str, torch.Tensor] = field(default_factory=dict)

    def fail(self, method: str, *errors: BaseException) -> None:
        """The next calls of `method` fail with `errors`, in order (then it works again)."""
        self.failures[method].extend(errors)

    def submit(self, method: str, compute: Any, **request: Any) -> FakeFuture:
        self.events.append(("submit", method))
        self.requests[method].append(request)
        if self.failures[method]:
            return FakeFuture(self, method, error=self.failures[method].pop(0))
        try:
            return FakeFuture(self, method, value=compute())
        except tinker.TinkerError as error:
            return FakeFuture(self, method, error=error)

    def base_logits(self, base_model: str) -> torch.Tensor:
        """[V, V] fixed logits of the next token given the previous one."""
        if base_model not in self.base_tables:
            vocab = self.models[base_model]
            generator = torch.Generator().manual_seed(len(base_model))
            self.base_tables[base_model] = torch.randn(vocab, vocab, generator=generator)
        return self.base_tables[base_model]


class FakeSamplingClient:
    """tinker.SamplingClient: sample() and compute_logprobs() with frozen weights."""

    def __init__(self, service: FakeService, base_model: str, policy: Policy) -> None:
        self.service, self.base_model, self.policy = service, base_model, policy

    def _logits(self, previous: torch.Tensor) -> torch.Tensor:
        return self.service.base_logits(self.base_model)[previous] + self.policy.lora_a[previous] @ self.policy.lora_b

    def sample(
        self,
        prompt: tinker.ModelInput,
        num_samples: int,
        sampling_params: tinker.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: tinker.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> FakeFuture:
        def compute() -> tinker.types.SampleResponse:
            stop = set(sampling_params.stop or [])
            sequences = []
            for index in range(num_samples):
                generator = torch.Generator().manual_seed((sampling_params.seed or 0) + index)
                last = torch.tensor(prompt.to_ints()[-1])
                tokens: list[int] = []
                logprobs: list[float] = []
                reason = "length"
                with torch.no_grad():
                    while len(tokens) < (sampling_params.max_tokens or 16):
                        logits = self._logits(last)
                        if sampling_params.temperature == 0:
                            token = int(logits.argmax())
                            logprob = float(torch.log_softmax(logits, -1)[token])
                        else:
                            tempered = torch.log_softmax(logits / sampling_params.temperature, -1)
                            token = int(torch.multinomial(tempered.exp(), 1, generator=generator))
                            logprob = float(tempered[token])
                        tokens.append(token)
                        logprobs.append(logprob)
                        last = torch.tensor(token)
                        if token in stop:
                            reason = "stop"
                            break
                sequences.append(
                    tinker.types.SampledSequence(
                        stop_reason=reason,
                        sequence_id=f"seq-{len(self.service.events)}-{index}",
                        tokens_np=np.array(tokens, dtype=np.int32),
                        logprobs_np=np.array(logprobs, dtype=np.float32),
                    )
                )
            return tinker.types.SampleResponse(sequences=sequences)

        return self.service.submit(
            "sample", compute, prompt=prompt.to_ints(), num_samples=num_samples, sampling_params=sampling_params
        )

    def compute_logprobs(self, prompt: tinker.ModelInput, prompt_logprobs_last_n: int | None = None) -> FakeFuture:
        def compute() -> list[float | None]:
            tokens = torch.tensor(prompt.to_ints())
            with torch.no_grad():
                scored = torch.log_softmax(self._logits(tokens[:-1]), -1).gather(1, tokens[1:, None]).squeeze(1)
            values: list[float | None] = [None, *scored.tolist()]
            if prompt_logprobs_last_n is not None:
                values = [None] * (len(values) - prompt_logprobs_last_n) + values[-prompt_logprobs_last_n:]
            return values

        return self.service.submit("compute_logprobs", compute, prompt=prompt.to_ints())


class FakeTrainingClient:
    """tinker.TrainingClient: forward, forward_backward, optim_step, save_state, save_weights_for_sampler."""

    def __init__(self, service: FakeService, base_model: str, policy: Policy) -> None:
        self.service, self.base_model, self.policy = service, base_model, policy
        self.run_id = f"run-{next(service.runs)}"
        self.policy.lora_b.requires_grad_(True)
        self.optimizer = torch.optim.AdamW([self.policy.lora_b])
        if policy.optimizer_state:
            self.optimizer.load_state_dict(policy.optimizer_state)

    def _datum_loss(
        self, datum: tinker.Datum, loss_fn: str, config: dict[str, Any] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.tensor(datum.model_input.to_ints())
        inputs = {key: value.to_torch() for key, value in datum.loss_fn_inputs.items()}
        targets = inputs["target_tokens"]
        if targets.shape != tokens.shape:
            raise status_error(tinker.BadRequestError, 400, "target_tokens must have one entry per model_input token")
        logits = self.service.base_logits(self.base_model)[tokens] + self.policy.lora_a[tokens] @ self.policy.lora_b
        logprobs = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        if loss_fn == "cross_entropy":
            return -(logprobs * inputs["weights"]).sum(), logprobs
        ratio = torch.exp(logprobs - inputs["logprobs"])
        if loss_fn == "importance_sampling":
            return -(ratio * inputs["advantages"]).sum(), logprobs
        if loss_fn == "ppo":
            low, high = (config or {}).get("clip_low_threshold", 0.8), (config or {}).get("clip_high_threshold", 1.2)
            clipped = ratio.clamp(low, high) * inputs["advantages"]
            return -torch.minimum(ratio * inputs["advantages"], clipped).sum(), logprobs
        raise status_error(tinker.BadRequestError, 400, f"loss {loss_fn} is not supported by the fake")

    def _fwd(self, data: list[tinker.Datum], loss_fn: str, config: dict[str, Any] | None, backward: bool) -> Any:
        total = torch.zeros(())
        outputs = []
        with torch.enable_grad() if backward else torch.no_grad():
            for datum in data:
                loss, logprobs = self._datum_loss(datum, loss_fn, config)
                total = total + loss
                outputs.append({"logprobs": tinker.TensorData.from_torch(logprobs.detach().float())})
            if backward:
                total.backward()
        return tinker.types.ForwardBackwardOutput(
            loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics={"loss:sum": float(total.detach())}
        )

    def forward(
        self, data: list[tinker.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None
    ) -> FakeFuture:
        return self.service.submit(
            "forward", lambda: self._fwd(data, loss_fn, loss_fn_config, False), data=data, loss_fn=loss_fn
        )

    def forward_backward(
        self, data: list[tinker.Datum], loss_fn: str, loss_fn_config: dict[str, Any] | None = None
    ) -> FakeFuture:
        return self.service.submit(
            "forward_backward",
            lambda: self._fwd(data, loss_fn, loss_fn_config, True),
            data=data,
            loss_fn=loss_fn,
            loss_fn_config=loss_fn_config,
        )

    def optim_step(self, optim_params: tinker.AdamParams | None = None, *, adam_params: Any = None) -> FakeFuture:
        params = optim_params if optim_params is not None else adam_params

        def compute() -> tinker.types.OptimStepResponse:
            for group in self.optimizer.param_groups:
                group.update(
                    lr=params.learning_rate,
                    betas=(params.beta1, params.beta2),
                    eps=params.eps,
                    weight_decay=params.weight_decay,
                )
            if params.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_([self.policy.lora_b], params.grad_clip_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return tinker.types.OptimStepResponse(metrics=None)

        return self.service.submit("optim_step", compute, adam_params=params)

    def _stored(self) -> Policy:
        stored = self.policy.copy()
        stored.optimizer_state = copy.deepcopy(self.optimizer.state_dict())
        return stored

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False, user_metadata: Any = None
    ) -> FakeFuture:
        def compute() -> tinker.types.SaveWeightsResponse:
            path = f"tinker://{self.run_id}/weights/{name}"
            if path in self.service.storage and not overwrite:
                raise status_error(tinker.ConflictError, 409, f"checkpoint {name} exists")
            self.service.storage[path] = (self.base_model, self._stored())
            return tinker.types.SaveWeightsResponse(path=path)

        return self.service.submit("save_state", compute, name=name, overwrite=overwrite)

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None, user_metadata: Any = None
    ) -> FakeFuture:
        def compute() -> tinker.types.SaveWeightsForSamplerResponse:
            path = f"tinker://{self.run_id}/sampler_weights/{name}"
            self.service.storage[path] = (self.base_model, self._stored())
            return tinker.types.SaveWeightsForSamplerResponse(path=path)

        return self.service.submit("save_weights_for_sampler", compute, name=name, ttl_seconds=ttl_seconds)


def fake_sdk(service: FakeService) -> types.ModuleType:
    """A `tinker` module whose clients are fakes talking to `service` (types and exceptions are the SDK's)."""
    module = types.ModuleType("tinker")
    module.__spec__ = tinker.__spec__  # it stands in for the installed package (importlib.util.find_spec asks)
    for name in tinker.__all__:
        setattr(module, name, getattr(tinker, name))

    class ServiceClient:
        """tinker.ServiceClient."""

        def __init__(
            self,
            user_metadata: dict[str, str] | None = None,
            project_id: str | None = None,
            *,
            display_name: str | None = None,
            base_url: str | None = None,
            api_key: str | None = None,
            **kwargs: Any,
        ) -> None:
            self.base_url, self.api_key = base_url, api_key
            service.requests["ServiceClient"].append({"base_url": base_url, "api_key": api_key})

        def _authorised(self) -> None:
            if self.api_key not in service.api_keys:
                raise status_error(tinker.AuthenticationError, 401, "Invalid API key")

        def create_lora_training_client(
            self,
            base_model: str,
            rank: int = 32,
            seed: int | None = None,
            train_mlp: bool = True,
            train_attn: bool = True,
            train_unembed: bool = True,
            user_metadata: dict[str, str] | None = None,
            optimizer: Any = None,
        ) -> FakeFuture:
            def compute() -> FakeTrainingClient:
                self._authorised()
                if base_model not in service.models:
                    raise status_error(tinker.BadRequestError, 400, f"Base model {base_model} is not supported")
                generator = torch.Generator().manual_seed(seed or 0)
                vocab, width = service.models[base_model], min(rank, LORA_RANK_CAP)
                policy = Policy(torch.randn(vocab, width, generator=generator), torch.zeros(width, vocab))
                return FakeTrainingClient(service, base_model, policy)

            return service.submit(
                "create_lora_training_client",
                compute,
                base_model=base_model,
                rank=rank,
                seed=seed,
                train_mlp=train_mlp,
                train_attn=train_attn,
                train_unembed=train_unembed,
            )

        def create_training_client_from_state_with_optimizer(
            self, path: str, base_model: str | None = None, user_metadata: Any = None, weights_access_token: Any = None
        ) -> FakeFuture:
            def compute() -> FakeTrainingClient:
                self._authorised()
                if path not in service.storage:
                    raise status_error(tinker.NotFoundError, 404, f"checkpoint {path} not found")
                stored_model, policy = service.storage[path]
                return FakeTrainingClient(service, stored_model, policy.copy())

            return service.submit("create_training_client_from_state_with_optimizer", compute, path=path)

        def create_sampling_client(
            self,
            model_path: str | None = None,
            base_model: str | None = None,
            retry_config: Any = None,
            record_stability_info: bool = False,
        ) -> FakeFuture:
            def compute() -> FakeSamplingClient:
                self._authorised()
                if model_path not in service.storage:
                    raise status_error(tinker.NotFoundError, 404, f"sampler weights {model_path} not found")
                stored_model, policy = service.storage[model_path]
                return FakeSamplingClient(service, stored_model, policy.copy())

            return service.submit("create_sampling_client", compute, model_path=model_path)

        def close(self, status: str, detail: str | None = None) -> FakeFuture:
            return service.submit("close", lambda: None, status=status)

    module.ServiceClient = ServiceClient  # type: ignore[attr-defined]
    module.TrainingClient = FakeTrainingClient  # type: ignore[attr-defined]
    module.SamplingClient = FakeSamplingClient  # type: ignore[attr-defined]
    module.APIFuture = FakeFuture  # type: ignore[attr-defined]
    return module
