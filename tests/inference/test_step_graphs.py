"""Decode steps recorded once per row bucket and replayed (inference.cuda_graphs; retrain/inference/sampler/
step_graphs.py) sample what eager steps sample.

A CUDA graph replays the kernels it recorded on the tensors it recorded them on: a host value the step used, a
tensor it built from one, or a tensor the host replaced since, is stale in a replay. The CPU has no CUDA graphs;
torch's own tracer (`make_fx`) records the same way: it runs the step, keeps the tensors it read as they are (the
same objects), bakes in whatever the host decided and built, and its replay runs the recorded ops on what those
tensors hold then. So these tests take it as the recorder in place of CUDA's, and what they check of the
product's side (the buffers, the sink rows, the buckets, one recording per bucket and call) is what a CUDA graph
relies on. tests/test_gpu.py replays real CUDA graphs when a GPU is there."""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from retrain.errors import ConfigError
from retrain.inference.config import PytorchEngineConfig
from retrain.inference.pytorch import records_steps
from retrain.inference.requests import TokenRequest
from retrain.inference.sampler.kv_budget import KvBudget, budget_blocks
from retrain.inference.sampler.kv_pool import KvPool, KvShape
from retrain.inference.sampler.step_graphs import Step, StepGraphs
from retrain.model.spec import ModelSpec
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine
from tests.inference.test_kv_budget import assert_same_rollouts, budget_gb, one_row_blocks

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# 16 rows: a bucket of 16 until 8 or fewer run, then of 8; rows stop at different lengths
GROUP = 4
SAMPLING = SamplingParams(max_tokens=40, temperature=2.5, top_p=0.95, return_entropies=True)


class TracingRecorder:
    """make_fx as the recorder (see the module docstring); counts recordings and replays."""

    def __init__(self) -> None:
        self.recorded = 0
        self.replayed = 0

    def __call__(self, step: Step) -> tuple[torch.Tensor, Step]:
        first = step()
        graph = make_fx(step)()
        self.recorded += 1

        def replay() -> torch.Tensor:
            self.replayed += 1
            return graph()

        return first, replay


@pytest.fixture(scope="module")
def backend():
    return make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4))


def recording_engine(backend, recorder: TracingRecorder, **options):
    engine = make_engine(backend, paged_attention="flex", **options)
    engine.step_recorder = lambda: recorder
    return engine


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_replayed_steps_sample_what_eager_steps_sample_as_rows_leave_queue_and_are_preempted(backend, prefix_caching):
    prompt_ids = encode(backend, PROMPTS)
    eager = make_engine(backend, paged_attention="flex", prefix_caching=prefix_caching)
    for blocks in (120, one_row_blocks(prompt_ids) + 1):  # all rows at once; rows queue and are preempted
        gb = budget_gb(eager, blocks)
        expected = make_engine(backend, paged_attention="flex", prefix_caching=prefix_caching, kv_cache_gb=gb)
        recorder = TracingRecorder()
        engine = recording_engine(backend, recorder, prefix_caching=prefix_caching, kv_cache_gb=gb)
        got = engine.generate(prompt_ids, GROUP, SAMPLING, 6)
        reference = expected.generate(prompt_ids, GROUP, SAMPLING, 6)
        assert_same_rollouts(got, reference)
        lengths = got.completion_mask.sum(dim=1)
        assert len(set(lengths.tolist())) > 4  # rows left at many different steps: the buffers' rows changed
        assert recorder.replayed > 4 * recorder.recorded > 0
        # a replay is a forward (it reads every weight once) that runs no module hook: the engine counts it (the
        # same forwards as eagerly where all rows fit; under the tight budget the sink block changes the queueing)
        assert got.metrics["engine/forwards"] > recorder.replayed
        if blocks == 120:
            assert got.metrics["engine/forwards"] == reference.metrics["engine/forwards"]


def test_a_call_records_each_bucket_once_and_the_next_call_sees_new_weights(backend):
    """The graphs live for one call: the first with 16 rows records the bucket of 16 and, once 8 or fewer run,
    the bucket of 8; the next call, after the adapter changed, records again and samples the new weights."""
    prompt_ids = encode(backend, PROMPTS)
    gb = budget_gb(make_engine(backend), 120)
    recorder = TracingRecorder()
    engine = recording_engine(backend, recorder, kv_cache_gb=gb, prefix_caching=False)
    expected = make_engine(backend, paged_attention="flex", kv_cache_gb=gb, prefix_caching=False)
    engine.generate(prompt_ids, GROUP, SAMPLING, 6)
    assert recorder.recorded == 2
    lora_b = next(p for name, p in backend.model.named_parameters() if "lora_B" in name)
    saved = lora_b.detach().clone()
    try:
        with torch.no_grad():
            lora_b.add_(torch.randn(lora_b.shape, generator=torch.Generator().manual_seed(1)))  # a step's update
        got = engine.generate(prompt_ids, GROUP, SAMPLING, 7)
        assert recorder.recorded == 4
        assert_same_rollouts(got, expected.generate(prompt_ids, GROUP, SAMPLING, 7))
    finally:
        with torch.no_grad():
            lora_b.copy_(saved)


def test_requests_that_join_a_running_call_sample_what_eager_steps_sample(backend):
    """The endpoint's requests: each with its own max_tokens, and more joining while the batch decodes (the rows
    grow into a larger bucket; the block tables widen for a longer request)."""
    prompt_ids = encode(backend, PROMPTS)
    requests = [
        TokenRequest(ids, SamplingParams(max_tokens=12 + 5 * i, temperature=1.5, top_p=0.9), seed=i)
        for i, ids in enumerate(prompt_ids * 2)
    ]
    late = [
        TokenRequest(ids, SamplingParams(max_tokens=30, temperature=1.5, top_p=0.9), seed=100 + i)
        for i, ids in enumerate(prompt_ids * 2)
    ]

    def run(engine) -> list:
        pending = [list(late)]

        def more(fits):
            return [request for request in pending.pop() if fits(request)] if pending else []

        return engine.generate_requests(requests, more=more)

    gb = budget_gb(make_engine(backend), 120)
    recorder = TracingRecorder()
    got = run(recording_engine(backend, recorder, kv_cache_gb=gb))
    expected = run(make_engine(backend, paged_attention="flex", kv_cache_gb=gb))
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), rtol=1e-5, atol=5e-5)
    assert len(got) == 16 and recorder.recorded >= 2


def test_a_step_that_cannot_be_recorded_runs_eagerly_and_says_so_once(backend, caplog):
    """Automatic (the default on a GPU): a recorder's failure on a device never tried before warns, naming the
    key, and the engine samples on eagerly, this call and the next."""
    prompt_ids = encode(backend, PROMPTS)
    gb = budget_gb(make_engine(backend), 120)
    calls = []

    def failing() -> object:
        calls.append(1)

        def record(step: Step) -> tuple[torch.Tensor, Step]:
            raise RuntimeError("operation not permitted when stream is capturing")

        return record

    engine = make_engine(backend, paged_attention="flex", kv_cache_gb=gb)
    engine.step_recorder = failing
    expected = make_engine(backend, paged_attention="flex", kv_cache_gb=gb)
    with caplog.at_level(logging.WARNING, logger="retrain.inference.pytorch"):
        got = engine.generate(prompt_ids, GROUP, SAMPLING, 6)
        assert_same_rollouts(
            engine.generate(prompt_ids, GROUP, SAMPLING, 8), expected.generate(prompt_ids, GROUP, SAMPLING, 8)
        )
    assert_same_rollouts(got, expected.generate(prompt_ids, GROUP, SAMPLING, 6))
    warnings = [record for record in caplog.records if "inference.cuda_graphs" in record.getMessage()]
    assert len(warnings) == 1 and "inference.cuda_graphs=false" in warnings[0].getMessage()
    assert calls == [1] and engine.step_recorder is None


def test_the_setting_is_checked_against_the_device_and_the_attention_path(backend):
    assert PytorchEngineConfig().cuda_graphs is None  # automatic
    assert not records_steps(None, True, CPU) and not records_steps(False, True, CUDA)
    assert records_steps(None, True, CUDA) and records_steps(True, True, CUDA)
    assert not records_steps(None, False, CUDA)  # gather: its shapes change every step
    with pytest.raises(ConfigError, match=r"inference.cuda_graphs=true records CUDA graphs.*on cpu"):
        records_steps(True, True, CPU)
    with pytest.raises(ConfigError, match=r"inference.cuda_graphs=true needs attention that reads the KV pool"):
        records_steps(True, False, CUDA)
    with pytest.raises(ConfigError, match="inference.cuda_graphs=true"):
        make_engine(backend, cuda_graphs=True)
    assert make_engine(backend, paged_attention="flex").step_recorder is None  # the CPU: steps run eagerly


def test_the_sink_block_is_no_rows_and_the_budget_counts_it():
    shape = KvShape(layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    pool = KvPool(shape, CPU, 10, reserve=True, sink=True)
    assert pool.sink == 9 and pool.capacity == 10 and pool.available() == 9
    taken = pool.take(9)
    assert pool.sink not in taken and pool.available() == 0
    pool.release(taken)
    assert pool.available() == 9 and pool.in_use == 0
    with pytest.raises(ValueError, match="sink block needs the storage reserved"):
        KvPool(shape, CPU, 10, sink=True)
    budget = KvBudget(10 * shape.block_bytes, "inference.kv_cache_gb=x")
    assert budget_blocks(budget, shape, 8 * 16) == 10  # 8 blocks and the copy of a shared one
    with pytest.raises(ConfigError, match="inference.kv_cache_gb"):
        budget_blocks(budget, shape, 9 * 16, sink=True)


@pytest.mark.parametrize("how", ["gather", "flex", "recorded", "replayed eagerly"])
def test_a_call_leaves_its_pool_to_no_reference_cycle(backend, how):
    """On a GPU the pool is the whole KV budget: held by a reference cycle (the cache and its layers) it stayed
    allocated after the call until Python's cycle collector ran, on the H200 through the trainer's step (48 GiB
    more at training's peak). Freed by reference counting alone now, the call's recorded steps with it."""
    gb = budget_gb(make_engine(backend), 120)
    engine = make_engine(backend, paged_attention="gather" if how == "gather" else "flex", kv_cache_gb=gb)
    if how == "recorded":
        engine.step_recorder = TracingRecorder
    elif how == "replayed eagerly":  # a replay that holds its step: the engine's fallback where recording fails
        engine.step_recorder = lambda: lambda step: (step(), step)
    gc.collect()
    gc.disable()
    try:
        engine.generate(encode(backend, PROMPTS), GROUP, SAMPLING, 6)
        left = [type(thing).__name__ for thing in gc.get_objects() if type(thing) in (KvPool, StepGraphs)]
    finally:
        gc.enable()
    assert left == []
