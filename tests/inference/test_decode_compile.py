"""A decode step of the GPU's path (the tiny Qwen3 in bf16, LoRA unmerged) compiles whole: its forward over the
paged KV cache and its draw are one graph for torch.compile(fullgraph=True, dynamic=False), the precondition for
capturing it in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from retrain.inference.sampler.decode import Forward, RunningTensors
from retrain.inference.sampler.kv_pool import KvPool
from retrain.inference.sampler.paged_cache import PagedCache, plan_forward
from retrain.inference.sampler.scheduler import Scheduler
from retrain.inference.sampler.tokens import choose_tokens
from retrain.model.lean_decoder import causal_lm_logits
from retrain.model.merged_lora import lean_lora, plain_lora_layers
from retrain.model.spec import ModelSpec
from retrain.model.train_mode import set_training
from retrain.types import SamplingParams
from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine

CPU = torch.device("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("paged_attention", [False, True])  # attention over a gathered copy; over the pool (flex)
def test_a_decode_step_compiles_into_one_graph_and_computes_what_the_eager_step_does(paged_attention: bool) -> None:
    torch._dynamo.reset()
    backend = make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4, dtype="bf16"))
    engine = make_engine(backend, merge_lora=False)
    model = engine.model
    set_training(model, False)
    prompts = [torch.tensor(ids) for ids in encode(backend, PROMPTS[:3])]
    assert len({len(ids) for ids in prompts}) > 1  # rows of different lengths: the step's mask has padding
    scheduler = Scheduler(KvPool(engine.kv_shape, CPU, 64), [len(ids) for ids in prompts], 1, 8, False, CPU)
    forward = Forward(model, PagedCache(scheduler.pool, engine.layer_types), scheduler, engine.pad_id, paged_attention)
    sampling = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9)
    with torch.inference_mode(), lean_lora(plain_lora_layers(model)):
        running = scheduler.admit().prefilled
        tokens = torch.stack(forward.prefill(running, prompts)).argmax(dim=-1)
        running = scheduler.make_room(running)
        steady = RunningTensors.of_rows(running, CPU)
        lengths = [row.stored + 1 for row in running]
        table = scheduler.table_rows(running, steady.table_rows)
        pool_blocks = scheduler.pool.capacity if paged_attention else None
        bounds, block_tokens = (min(lengths), max(lengths)), scheduler.pool.shape.block_tokens
        plan = plan_forward(table, steady.lengths, bounds, tokens.unsqueeze(-1), None, block_tokens, pool_blocks)
        forward.cache.plan = plan
        if paged_attention:
            assert plan.block_mask is not None and plan.attention_mask is None
        else:
            assert plan.padded and plan.attention_mask is not None

        def step(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, uniforms: torch.Tensor):
            logits = causal_lm_logits(model, ids, mask, positions, forward.cache, logits_to_keep=1, padded=plan.padded)
            choice = choose_tokens(logits[:, -1], sampling, uniforms, with_entropy=True)
            return choice.tokens, choice.logprobs, choice.entropies

        uniforms = torch.rand(len(running), generator=torch.Generator().manual_seed(0))
        arguments = (plan.input_ids, plan.attention_mask, plan.position_ids, uniforms)
        eager = step(*arguments)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(*arguments)  # a graph break raises
    assert torch.equal(compiled[0], eager[0])
    for got, want in zip(compiled[1:], eager[1:], strict=True):
        torch.testing.assert_close(got, want, rtol=0.0, atol=3e-2)  # bf16 logits; inductor fuses differently
