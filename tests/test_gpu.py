"""The quickstart on a CUDA GPU, end to end: what docs/reproducibility.md promises there.

Skipped where no GPU is visible (CI has none); run on a lent GPU with `pytest tests/test_gpu.py`.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import pytest
import torch

from retrain.assets import TINY_MODEL_DIR
from retrain.model.attention import CUDA_SDPA
from retrain.model.lean_decoder import LeanForward, causal_lm_logits
from retrain.model.merged_lora import lean_lora, plain_lora_layers
from retrain.model.rows import positions_from_mask
from retrain.model.spec import ModelSpec
from tests.conftest import read_metrics, run_cli, sigkill_once_checkpointed, without_timing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ON_GPU = ["experiment=quickstart", "eval.num_examples=0", "logging.progress_bar=false", "backend.devices=gpu:0"]
DETERMINISTIC = "training.deterministic=true"
STEPS = 8


def gpu_run(tmp_path: Path, name: str, *extra: str, steps: int = STEPS) -> list[dict]:
    run_dir = tmp_path / name
    run_cli(
        [*ON_GPU, f"training.max_steps={steps}", f"hydra.run.dir={run_dir}", *extra], cwd=tmp_path, one_thread=False
    )
    return without_timing(read_metrics(run_dir))


def test_a_model_on_the_gpu_attends_without_cudnn_and_as_sdpa_does() -> None:
    """cuDNN's attention plans per shape, and RL's shapes change on every call (retrain/model/attention.py)."""
    model = ModelSpec(name_or_path=str(TINY_MODEL_DIR), lora_rank=8).load_lora_model(torch.device("cuda", 0), seed=0)
    assert model.config._attn_implementation == CUDA_SDPA
    ids = torch.randint(0, 250, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        model.base_model.model.set_attn_implementation("sdpa")
        theirs = model(input_ids=ids, attention_mask=mask).logits
    # bf16: kernels may differ in rounding only. A padding position attends to nothing, and kernels return
    # different values there (never read), so only real positions are compared.
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=2e-2, atol=2e-2)


def test_a_deterministic_gpu_run_repeats_bit_for_bit(tmp_path: Path) -> None:
    first = gpu_run(tmp_path, "a", DETERMINISTIC)
    assert first == gpu_run(tmp_path, "b", DETERMINISTIC)
    assert first != gpu_run(tmp_path, "c", DETERMINISTIC, "training.seed=1")
    assert all(record["num_datums"] > 0 for record in first), "a step without a trained row proves little"


def test_a_default_gpu_run_samples_the_same_first_step(tmp_path: Path) -> None:
    """Without training.deterministic the fast kernels may round differently once the weights have been
    updated; the first step samples from the same initial adapter with the same seeded generator."""
    first, second = gpu_run(tmp_path, "a"), gpu_run(tmp_path, "b")
    sampled = ["mean_reward", "correct_rate", "mean_completion_tokens", "num_datums"]
    assert [first[0][key] for key in sampled] == [second[0][key] for key in sampled]


def test_a_killed_deterministic_gpu_run_resumes_exactly(tmp_path: Path) -> None:
    reference = gpu_run(tmp_path, "full", DETERMINISTIC, "training.save_every=1")
    run_dir = tmp_path / "killed"
    args = [*ON_GPU, f"training.max_steps={STEPS}", DETERMINISTIC, "training.save_every=1", f"hydra.run.dir={run_dir}"]
    sigkill_once_checkpointed(args, tmp_path, run_dir / "checkpoints" / "step_3")
    assert not (run_dir / "final").exists(), "the run finished before it could be killed"
    run_cli(args, cwd=tmp_path, one_thread=False)
    assert without_timing(read_metrics(run_dir)) == reference


def test_on_the_gpu_the_lean_lora_forward_trains_as_peft_does_in_bf16() -> None:
    """The GPU default is bf16: the lean forward's LoRA branch runs in bf16 (fp32 master weights), PEFT's in fp32;
    the same loss and fp32 gradients within bf16's rounding."""
    model = ModelSpec(name_or_path=str(TINY_MODEL_DIR), lora_rank=8).load_lora_model(torch.device("cuda", 0), seed=0)
    assert model.dtype == torch.bfloat16
    model.eval()  # no dropout draws between the two passes
    with torch.no_grad():  # a nonzero B, so every LoRA matmul carries gradient
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 250, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    layers = plain_lora_layers(model)
    assert layers

    def loss_and_gradients(lean: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with lean_lora(layers) if lean else contextlib.nullcontext():
            loss = model(input_ids=ids).logits.float().log_softmax(-1).square().mean()
        loss.backward()
        gradients = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)
        return loss.detach(), gradients

    lean_loss, lean_gradients = loss_and_gradients(lean=True)
    peft_loss, peft_gradients = loss_and_gradients(lean=False)
    torch.testing.assert_close(lean_loss, peft_loss, rtol=2e-2, atol=0)
    lean, peft = torch.cat([g.flatten() for g in lean_gradients]), torch.cat([g.flatten() for g in peft_gradients])
    assert lean.dtype == torch.float32
    assert (lean - peft).norm() <= 0.05 * peft.norm()


def test_on_the_gpu_the_lean_decoder_gives_transformers_logits_and_gradients_within_bf16_rounding() -> None:
    """retrain/model/lean_decoder.py mirrors transformers' forward op for op, each RMSNorm torch's fused rms_norm
    (rounded once where transformers rounds twice); its training forward computes the sampler's logits to the bit,
    through plain linears and through the unmerged adapter (fp32 master weights, the branch in bf16)."""
    model = ModelSpec(name_or_path=str(TINY_MODEL_DIR), lora_rank=8).load_lora_model(torch.device("cuda", 0), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
            elif "norm" in name:
                p.normal_(mean=1.0, std=0.2)
    assert LeanForward.of(model) is not None
    ids = torch.randint(0, 250, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    positions = positions_from_mask(mask.bool())

    def logits_and_gradients(forward) -> tuple[torch.Tensor, torch.Tensor]:
        with lean_lora(plain_lora_layers(model)):
            logits = forward(model, ids, mask, positions)
        logits.float().log_softmax(-1).square().mean().backward()
        gradients = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return logits.detach().float(), gradients

    def transformers_forward(model, ids, mask, positions) -> torch.Tensor:
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits

    model.eval()  # no dropout draws between the passes
    lean_logits, lean_gradients = logits_and_gradients(causal_lm_logits)
    reference_logits, reference_gradients = logits_and_gradients(transformers_forward)
    torch.testing.assert_close(lean_logits, reference_logits, atol=0.05 * reference_logits.abs().max(), rtol=0)
    assert (lean_gradients - reference_gradients).norm() <= 0.05 * reference_gradients.norm()
    for adapter in (model.disable_adapter, contextlib.nullcontext):
        trained_and_sampled = []
        for grad in (True, False):
            with torch.set_grad_enabled(grad), adapter(), lean_lora(plain_lora_layers(model)):
                trained_and_sampled.append(causal_lm_logits(model, ids, mask, positions).detach())
        assert torch.equal(*trained_and_sampled), adapter


def test_on_the_gpu_a_bf16_model_writes_fp32_logits_with_a_bf16_linear_s_gradient() -> None:
    """retrain/model/output_logits.py: the head's matmul writes fp32 (no bf16 rounding of a logit), through
    transformers' forward and the lean one, and its backward is a bf16 linear's."""
    model = ModelSpec(name_or_path=str(TINY_MODEL_DIR), lora_rank=8).load_lora_model(torch.device("cuda", 0), seed=0)
    head = model.get_base_model().lm_head
    assert model.dtype == torch.bfloat16 and "forward" in vars(head)
    ids = torch.randint(0, 250, (3, 10), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    lean = causal_lm_logits(model, ids, mask, positions_from_mask(mask.bool()))
    own = model(input_ids=ids, attention_mask=mask).logits
    assert lean.dtype == own.dtype == torch.float32
    hidden = torch.randn(7, head.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    logits = head(hidden)
    reference = hidden.detach().float() @ head.weight.float().t()
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)  # fp32 sums of the same products
    weights = torch.randn_like(logits)
    (logits * weights).sum().backward()
    torch.testing.assert_close(hidden.grad, (weights.bfloat16() @ head.weight).to(hidden.grad.dtype))


def test_on_the_gpu_replayed_cuda_graphs_sample_what_the_same_steps_sample_eagerly() -> None:
    """inference.cuda_graphs (the GPU's default): each row bucket's decode forward, recorded as a CUDA graph and
    replayed, samples exactly what the same bucketed steps sample run eagerly (same kernels, same shapes), as rows
    leave and queue; and a replayed step launches a graph and the draw's kernels, not every op of the forward."""
    from torch.profiler import ProfilerActivity, profile

    from retrain.types import SamplingParams
    from tests.backend.tiny_model import PROMPTS, encode, make_backend, make_engine
    from tests.inference.test_kv_budget import assert_same_rollouts, budget_gb

    backend = make_backend(ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4, dtype="bf16"), devices="gpu:0")
    prompt_ids = encode(backend, PROMPTS)
    sampling = SamplingParams(max_tokens=40, temperature=2.5, top_p=0.95, return_entropies=True)
    for blocks in (120, 12):  # all rows at once; rows queue
        gb = budget_gb(make_engine(backend), blocks)
        graphs = make_engine(backend, kv_cache_gb=gb)
        assert graphs.paged_attention and graphs.step_recorder is not None  # the defaults on a GPU
        eager = make_engine(backend, kv_cache_gb=gb)
        eager.step_recorder = lambda: lambda step: (step(), step)  # the same bucketed steps, run each time
        assert_same_rollouts(graphs.generate(prompt_ids, 4, sampling, 6), eager.generate(prompt_ids, 4, sampling, 6))
    gb = budget_gb(make_engine(backend), 120)
    launches = {}
    for recorded in (True, False):
        engine = make_engine(backend, kv_cache_gb=gb, cuda_graphs=recorded)
        engine.generate(prompt_ids, 4, sampling, 6)  # flex_attention compiles its kernels for these shapes
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            rollouts = engine.generate(prompt_ids, 4, sampling, 6)
        events = [event.name for event in trace.events()]
        launches[recorded] = sum(
            events.count(name) for name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
        )
        if recorded:
            steps = int(rollouts.completion_mask.sum(dim=1).max())
            assert events.count("cudaGraphLaunch") >= steps - 4  # every decode step but each bucket's first
    assert launches[True] < 0.5 * launches[False], launches  # 4 layers of ~40 ops a step, now one graph launch
    engine = make_engine(backend, kv_cache_gb=gb)
    engine.generate(prompt_ids, 4, sampling, 6)
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    gc.disable()  # freed by reference counting, when the call returns: not whenever the cycle collector runs
    try:
        for seed in (7, 8, 9):
            engine.generate(prompt_ids, 4, sampling, seed)
            assert torch.cuda.memory_allocated() == allocated  # the pool and the graphs went with the call
    finally:
        gc.enable()
    assert torch.cuda.memory_reserved() <= reserved  # each call's graph memory went back to CUDA
