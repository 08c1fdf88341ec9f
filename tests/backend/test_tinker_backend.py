"""backend=tinker through a fake of the SDK's clients (tests/backend/fake_tinker.py): datums with the
position shift, the loss and optimizer settings sent, futures submitted together, versioned sampler
weights the engine switches to, both probe paths, checkpoints that resume exactly, and the errors."""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from retrain.backend.capabilities import describe_backend
from retrain.backend.settings import LossSettings
from retrain.backend.tinker.backend import STATE_FILE
from retrain.backend.tinker.calls import TinkerAuthError, TinkerRateLimitError, TinkerServiceError
from retrain.backend.tinker.config import TinkerBackendConfig
from retrain.backend.tinker.datums import step_datums
from retrain.errors import ConfigError
from retrain.model.probe import Probe, StaleWeightsError
from retrain.training.freshness import FreshnessProof
from retrain.types import Rollouts, SamplingParams, TrainBatch, WeightUpdate
from tests.backend.fake_tinker import FakeService, status_error
from tests.backend.tinker_helpers import FAKE_KEY, OPTIM, make_backend, service, tiny_tokenizer, token_advantages

__all__ = ["service", "tiny_tokenizer"]  # fixtures

SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0)
PROMPTS = [[10, 11, 12], [20, 21]]


def sample_batch(engine, advantages: list[float], seed: int = 7) -> TrainBatch:
    rollouts = engine.generate(PROMPTS, 2, SAMPLING, seed)
    return TrainBatch(
        rollouts=rollouts,
        advantages=token_advantages(rollouts, advantages),
        row_mask=torch.tensor([a != 0 for a in advantages]),
    )


def hand_made_rollouts() -> Rollouts:
    """One left-padded prompt of 3 tokens, two completions (3 tokens and 2 tokens + padding)."""
    return Rollouts(
        prompt_ids=torch.tensor([[0, 5, 6, 7]]),
        prompt_mask=torch.tensor([[False, True, True, True]]),
        completion_ids=torch.tensor([[8, 9, 10], [11, 12, 0]]),
        completion_mask=torch.tensor([[True, True, True], [True, True, False]]),
        logprobs=torch.tensor([[-0.5, -0.6, -0.7], [-1.5, -1.6, 0.0]]),
        texts=["a", "b"],
        group_size=2,
        hit_max_tokens=torch.tensor([True, False]),
    )


def test_datums_shift_tokens_by_one_and_zero_the_prompt_positions(service: FakeService) -> None:
    import tinker  # the fake module: its types are the SDK's own

    rollouts = hand_made_rollouts()
    advantages = torch.tensor([[1.0, 0.0, 2.0], [-1.0, -1.0, 0.0]])
    step = step_datums(tinker, TrainBatch(rollouts, advantages, row_mask=torch.tensor([True, True])))
    assert step.num_tokens == 4  # the 0-advantage token and the padding leave the mean
    first, second = step.datums
    assert first.model_input.to_ints() == [5, 6, 7, 8, 9]
    assert first.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9, 10]
    assert first.loss_fn_inputs["logprobs"].tolist() == pytest.approx([0, 0, -0.5, -0.6, -0.7])
    assert first.loss_fn_inputs["advantages"].tolist() == pytest.approx([0, 0, 0.25, 0.0, 0.5])
    assert second.model_input.to_ints() == [5, 6, 7, 11]
    assert second.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 11, 12]
    assert second.loss_fn_inputs["advantages"].tolist() == pytest.approx([0, 0, -0.25, -0.25])
    only_first = step_datums(tinker, TrainBatch(rollouts, advantages, row_mask=torch.tensor([True, False])))
    assert only_first.rows == [0] and only_first.num_tokens == 2
    rollouts.sampled_mask = torch.tensor([[True, True, False], [True, True, False]])  # token 10: an environment's
    without_context = step_datums(tinker, TrainBatch(rollouts, advantages, row_mask=torch.tensor([True, True])))
    assert without_context.num_tokens == 3
    assert without_context.datums[0].loss_fn_inputs["advantages"].tolist() == pytest.approx([0, 0, 1 / 3, 0, 0])


def test_a_step_sends_the_loss_and_adam_settings_then_publishes_versioned_sampler_weights(
    service: FakeService, tiny_tokenizer
) -> None:
    backend = make_backend()
    engine = backend.sampling_engine(tiny_tokenizer)
    assert engine.weights_version == 0 and engine.model_path.endswith("/sampler_weights/policy-v0")
    create = service.requests["create_lora_training_client"][0]
    assert (create["base_model"], create["rank"], create["seed"]) == ("retrain:tiny_qwen3", 8, 3)
    assert (create["train_attn"], create["train_mlp"], create["train_unembed"]) == (True, True, False)
    assert service.requests["ServiceClient"] == [{"base_url": None, "api_key": FAKE_KEY}]

    batch = sample_batch(engine, [1.0, -1.0, 0.5, 0.0])
    service.events.clear()
    result = backend.train(batch)

    submitted = service.events.index(("submit", "optim_step"))
    assert (
        service.events.index(("submit", "forward_backward"))
        < submitted
        < service.events.index(("result", "forward_backward"))
    )
    sent = service.requests["forward_backward"][-1]
    assert sent["loss_fn"] == "importance_sampling" and sent["loss_fn_config"] is None
    assert len(sent["data"]) == 3  # the row outside row_mask is not sent
    adam = service.requests["optim_step"][-1]["adam_params"]
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm) == (
        OPTIM.lr,
        0.9,
        0.99,
        1e-8,
        0.01,
        1.0,
    )
    # sampled by version 0 and trained from version 0: ratio 1, so the loss is −mean(A) over the trained tokens
    contributing = batch.rollouts.completion_mask & batch.row_mask[:, None]
    assert result.num_tokens == int(contributing.sum())
    assert result.loss == pytest.approx(-float(batch.advantages[contributing].sum()) / result.num_tokens, abs=1e-5)
    assert result.metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["engine/logprob_abs_diff"] == pytest.approx(0.0, abs=1e-5)
    assert result.grad_norm == 0.0  # the service reports none
    assert result.update == WeightUpdate(version=1, remote=result.update.remote)
    assert result.update.remote.endswith("/sampler_weights/policy-v1")


def test_the_engine_serves_each_new_version_and_both_probe_paths_agree(service: FakeService, tiny_tokenizer) -> None:
    backend = make_backend()
    engine = backend.sampling_engine(tiny_tokenizer)
    proof = FreshnessProof(Probe.from_tokenizer(tiny_tokenizer), backend)
    assert proof.check(engine, 0).gap < 1e-5
    before = engine.probe_logprobs(proof.probe)
    update = backend.train(sample_batch(engine, [1.0, -1.0, 1.0, -1.0])).update
    assert update is not None
    # not synced yet: the sampler still serves version 0, the trainer has moved on
    assert torch.equal(engine.probe_logprobs(proof.probe), before)
    assert not torch.allclose(backend.probe_logprobs(proof.probe), before, atol=1e-4)
    engine.sync(update)
    freshness = proof.check(engine, update.version)
    assert freshness.gap < 1e-5 and freshness.shift > 1e-4
    assert not torch.allclose(engine.probe_logprobs(proof.probe), before)
    assert service.requests["compute_logprobs"] and service.requests["forward"]  # two real paths
    with pytest.raises(StaleWeightsError, match="older"):
        engine.sync(WeightUpdate(version=0, remote="tinker://run-0/sampler_weights/policy-v0"))


def test_generate_returns_group_major_rows_seeded_from_the_generator_seed(service: FakeService, tiny_tokenizer) -> None:
    engine = make_backend().sampling_engine(tiny_tokenizer)
    first = engine.generate(PROMPTS, 3, SAMPLING, 11)
    again = engine.generate(PROMPTS, 3, SAMPLING, 11)
    other = engine.generate(PROMPTS, 3, SAMPLING, 12)
    assert first.completion_ids.shape[0] == 6 and first.batch_size == 2 and len(first.texts) == 6
    assert torch.equal(first.completion_ids, again.completion_ids) and not torch.equal(
        first.completion_ids, other.completion_ids
    )
    requests = service.requests["sample"][-6:]
    assert [r["prompt"] for r in requests[:2]] == PROMPTS and all(r["num_samples"] == 3 for r in requests)
    seeds = [r["sampling_params"].seed for r in requests]
    assert seeds[0] != seeds[1] and seeds[:2] == seeds[2:4] and seeds[:2] != seeds[4:]
    lengths = first.completion_mask.sum(dim=1)
    assert torch.equal(first.hit_max_tokens, lengths == SAMPLING.max_tokens)
    assert first.texts[0] == tiny_tokenizer.decode(first.completion_ids[0, : lengths[0]], skip_special_tokens=True)
    assert bool((first.logprobs[first.completion_mask] < 0).all())


def test_clip_eps_selects_the_sdk_ppo_loss_with_our_thresholds(service: FakeService, tiny_tokenizer) -> None:
    backend = make_backend(loss=LossSettings(clip_eps=0.2, clip_eps_high=0.28))
    backend.train(sample_batch(backend.sampling_engine(tiny_tokenizer), [1.0, -1.0, 1.0, -1.0]))
    sent = service.requests["forward_backward"][-1]
    assert sent["loss_fn"] == "ppo"
    assert sent["loss_fn_config"] == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})


def test_a_checkpoint_resumes_weights_and_optimizer_exactly(
    service: FakeService, tiny_tokenizer, tmp_path: Path
) -> None:
    backend = make_backend()
    engine = backend.sampling_engine(tiny_tokenizer)
    backend.train(sample_batch(engine, [1.0, -1.0, 1.0, -1.0], seed=1))
    backend.save(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / STATE_FILE).read_text())
    assert saved["weights_version"] == 1 and saved["tinker_path"].startswith("tinker://")
    assert service.requests["save_state"][-1]["name"] == "retrain-v1"
    second = sample_batch(engine, [0.5, -0.5, 1.0, -1.0], seed=2)
    continued = backend.train(second)
    probe = Probe.from_tokenizer(tiny_tokenizer)

    resumed = make_backend(seed=99)  # a new process: a new ServiceClient and a fresh training client
    update = resumed.load(tmp_path / "ckpt")
    assert update.version == 1 and update.remote.endswith("/sampler_weights/policy-v1")
    assert service.requests["create_training_client_from_state_with_optimizer"][-1]["path"] == saved["tinker_path"]
    again = resumed.train(second)
    assert again.loss == pytest.approx(continued.loss, abs=1e-6) and again.update.version == 2
    assert torch.allclose(resumed.probe_logprobs(probe), backend.probe_logprobs(probe), atol=1e-6)


def test_a_checkpoint_of_another_model_or_one_the_service_lost_is_refused(service: FakeService, tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {"tinker_path": "tinker://gone/weights/x", "weights_version": 2, "base_model": "other", "lora_rank": 8}
        )
    )
    with pytest.raises(ConfigError, match="model.name_or_path"):
        make_backend().load(tmp_path)
    (tmp_path / STATE_FILE).write_text(
        json.dumps(
            {
                "tinker_path": "tinker://gone/weights/x",
                "weights_version": 2,
                "base_model": "retrain:tiny_qwen3",
                "lora_rank": 8,
            }
        )
    )
    with pytest.raises(Exception, match="cannot restore tinker://gone/weights/x"):
        make_backend().load(tmp_path)


def test_without_the_sdk_the_error_says_which_extra_to_install(
    service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tinker", None)  # what `import tinker` meets when the extra is missing
    with pytest.raises(ConfigError, match=re.escape("pip install 'retrain[tinker]'")):
        make_backend()


def test_no_key_or_a_malformed_key_is_a_config_error_naming_the_variable(
    service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TINKER_API_KEY")
    with pytest.raises(ConfigError, match="TINKER_API_KEY"):
        make_backend()
    monkeypatch.setenv("TINKER_API_KEY", "sk-not-tinker")
    with pytest.raises(ConfigError, match="TINKER_API_KEY"):
        make_backend()
    assert not service.requests["ServiceClient"]


def test_a_rejected_key_fails_at_once_without_showing_the_key(
    service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-revoked-secret")
    with pytest.raises(TinkerAuthError, match="TINKER_API_KEY") as error:
        make_backend()
    assert "tml-revoked-secret" not in str(error.value)
    assert len(service.requests["create_lora_training_client"]) == 1  # a 401 is not retried


def test_an_unknown_model_is_a_config_error_naming_the_model(service: FakeService) -> None:
    from retrain.backend.tinker.backend import TinkerBackend
    from retrain.model.spec import ModelSpec

    with pytest.raises(ConfigError, match="model.name_or_path='org/unknown'"):
        TinkerBackend(
            TinkerBackendConfig(),
            model=ModelSpec(name_or_path="org/unknown"),
            optim=OPTIM,
            loss=LossSettings(0.0, None),
            seed=0,
        )


def test_retryable_errors_are_retried_a_bounded_number_of_times(service: FakeService, tiny_tokenizer) -> None:
    import tinker

    engine = make_backend(max_retries=2).sampling_engine(tiny_tokenizer)
    service.fail(
        "sample",
        status_error(tinker.RateLimitError, 429, "slow down"),
        status_error(tinker.InternalServerError, 503, "x"),
    )
    assert engine.generate(PROMPTS[:1], 2, SAMPLING, 1).num_rows == 2
    assert len(service.requests["sample"]) == 3
    service.fail("sample", *[status_error(tinker.RateLimitError, 429, "slow down") for _ in range(3)])
    with pytest.raises(TinkerRateLimitError, match=r"429.*after 2 retries.*max_concurrent_calls"):
        engine.generate(PROMPTS[:1], 2, SAMPLING, 1)
    service.fail("sample", status_error(tinker.BadRequestError, 400, "prompt too long"))
    with pytest.raises(TinkerServiceError, match="prompt too long"):
        engine.generate(PROMPTS[:1], 2, SAMPLING, 1)


def test_a_training_step_is_never_sent_twice(service: FakeService, tiny_tokenizer) -> None:
    import tinker

    backend = make_backend(max_retries=3)
    batch = sample_batch(backend.sampling_engine(tiny_tokenizer), [1.0, -1.0, 1.0, -1.0])
    service.fail("optim_step", status_error(tinker.InternalServerError, 500, "optimizer crashed"))
    with pytest.raises(TinkerServiceError, match="training a step.*optimizer crashed"):
        backend.train(batch)
    assert len(service.requests["forward_backward"]) == 1


def test_options_are_validated_naming_their_key() -> None:
    """Checked where the run's parts are planned (retrain.run.plan_parts), before anything is built."""
    options = describe_backend("retrain.backend.tinker.backend.TinkerBackend")
    with pytest.raises(ConfigError, match="backend.max_concurrent_calls"):
        options.check_options({"max_concurrent_calls": 0})
    with pytest.raises(ConfigError, match="backend.sampler_ttl_s"):
        options.check_options({"sampler_ttl_s": 60})
    with pytest.raises(ConfigError, match="backend.max_retries"):
        options.check_options({"max_retries": -1})


def test_base_url_comes_from_the_config_else_the_environment(
    service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    with listening() as env_url, listening() as config_url:
        monkeypatch.setenv("TINKER_BASE_URL", env_url)
        make_backend()
        make_backend(base_url=config_url)
    assert [r["base_url"] for r in service.requests["ServiceClient"]] == [env_url, config_url]


def test_a_url_nothing_listens_at_fails_in_seconds_naming_it(service: FakeService) -> None:
    with listening() as url:
        pass  # closed again: the port refuses connections now
    started = time.monotonic()
    with pytest.raises(
        TinkerServiceError, match=rf"cannot reach the Tinker service at {re.escape(url)} \(backend.base_url"
    ):
        make_backend(base_url=url)
    assert time.monotonic() - started < 5
    assert "ServiceClient" not in service.requests  # failed before the SDK was asked to connect


@contextmanager
def listening() -> Iterator[str]:
    """The URL of a TCP port on loopback that accepts connections while the block runs."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
