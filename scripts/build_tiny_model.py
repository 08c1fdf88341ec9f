"""Build the bundled tiny model: a ~1M-parameter Qwen3 warm-started on the arithmetic task.

The offline quickstart needs a real Hugging Face model that loads with no download, trains in
seconds on a CPU and has room to improve under RL. This script makes one from scratch:

1. a byte-level tokenizer (one token per ASCII character, no merges) with ChatML special tokens and
   `\\boxed{` as a single token, so an answer `\\boxed{85}<|im_end|>` costs 5 tokens;
2. a randomly initialised Qwen3ForCausalLM;
3. supervised training on chat-formatted `prompt -> \\boxed{answer}<|im_end|>` over the training
   problems of retrain.data.arithmetic, stopped as soon as its *sampled* held-out accuracy reaches a
   target (deliberately well below 100%, so RL has something to learn).

Everything is seeded and runs on one CPU thread with deterministic ops: the same command writes the
same weights. Usage:

    python scripts/build_tiny_model.py --out retrain/assets/tiny_qwen3
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from retrain.data.arithmetic import ArithmeticData, ArithmeticDataConfig
from retrain.types import Example

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
BOXED_TOKEN = "\\boxed{"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_POSITIONS = 128
LAST_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass
class BuildArgs:
    """What decides the weights; written next to them so a build can be repeated exactly."""

    seed: int = 0
    max_steps: int = 3000
    target_accuracy: float = 0.40  # stop once sampled held-out accuracy reaches this
    eval_every: int = 25
    eval_size: int = 500
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level alphabet without merges: any text round-trips, ASCII costs one token per char."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # Without a decoder, tokenizers joins tokens with spaces; ByteLevel maps them back to text.
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in (PAD_TOKEN, IM_START, EOS_TOKEN)]
    )
    tokenizer.add_tokens([AddedToken(BOXED_TOKEN, special=False, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def prompt_ids(tokenizer: PreTrainedTokenizerFast, example: Example) -> list[int]:
    messages = [{"role": "user", "content": example.prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def supervised_batch(tokenizer: PreTrainedTokenizerFast, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer rows; only the answer tokens (EOS included) carry a label."""
    rows, labels = [], []
    for example in examples:
        prompt = prompt_ids(tokenizer, example)
        answer = tokenizer.encode(f"{BOXED_TOKEN}{example.reference}}}", add_special_tokens=False)
        answer.append(tokenizer.eos_token_id)
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    return {
        "input_ids": torch.tensor([row + [pad] * (width - len(row)) for row in rows]),
        "attention_mask": torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows]),
        "labels": torch.tensor([row + [-100] * (width - len(row)) for row in labels]),
    }


def is_correct(completion: str, reference: str) -> bool:
    """Correct iff the last `\\boxed{...}` in the completion holds exactly the reference."""
    boxed = LAST_BOXED.findall(completion)
    return bool(boxed) and boxed[-1] == reference


@torch.no_grad()
def held_out_accuracy(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    examples: list[Example],
    sample: bool,
    seed: int,
    max_new_tokens: int = 8,
) -> float:
    """Accuracy of one completion per problem: sampled at temperature 1, top_p 1, or greedy."""
    prompts = [prompt_ids(tokenizer, example) for example in examples]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # top_k=0: generate() would otherwise keep only the 50 likeliest tokens when sampling.
        sampling = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0} if sample else {"do_sample": False}
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, **sampling
        )
    model.train()
    completions = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
    correct = sum(is_correct(text, ex.reference) for text, ex in zip(completions, examples))
    return correct / len(examples)


def warm_start(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, data: ArithmeticData, args: BuildArgs
) -> dict[str, float]:
    """Cross-entropy on the training problems until sampled held-out accuracy hits the target."""
    held_out = data.held_out(args.eval_size)
    train = data.train_examples
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    order = torch.Generator().manual_seed(args.seed)
    model.train()
    step = 0
    while step < args.max_steps:
        indices = torch.randint(len(train), (args.batch_size,), generator=order).tolist()
        loss = model(**supervised_batch(tokenizer, [train[i] for i in indices])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if args.eval_every and step % args.eval_every == 0:
            sampled = held_out_accuracy(model, tokenizer, held_out, sample=True, seed=args.seed)
            print(f"step {step:5d}  loss {loss.item():.4f}  sampled held-out accuracy {sampled:.3f}", flush=True)
            if sampled >= args.target_accuracy:
                break
    return {
        "steps": step,
        "final_loss": round(loss.item(), 6),
        "held_out_sampled_accuracy": held_out_accuracy(model, tokenizer, held_out, sample=True, seed=args.seed),
        "held_out_greedy_accuracy": held_out_accuracy(model, tokenizer, held_out, sample=False, seed=args.seed),
    }


def save(out: Path, model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # transformers 5 writes its own backend name here; the generic fast class also loads in 4.x and
    # keeps AutoTokenizer from substituting Qwen's tokenizer for model_type qwen3.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    (out / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def parse_args(argv: list[str] | None) -> tuple[Path, BuildArgs]:
    defaults = BuildArgs()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parsed = vars(parser.parse_args(argv))
    out = parsed.pop("out")
    if parsed["max_steps"] < 1:
        parser.error(f"--max-steps must be at least 1, got {parsed['max_steps']}")
    return out, BuildArgs(**parsed)


def main(argv: list[str] | None = None) -> dict:
    out, args = parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    data = ArithmeticData(ArithmeticDataConfig(), seed=args.seed)
    results = warm_start(model, tokenizer, data, args)
    info = {
        "build_args": asdict(args),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "build_seconds": round(time.perf_counter() - started, 1),
        "torch_version": torch.__version__,
        **results,
    }
    save(out, model, tokenizer, info)
    print(
        f"wrote {out}: {info['num_parameters']:,} parameters, {results['steps']} steps, "
        f"{info['build_seconds']} s; held-out ({args.eval_size}) greedy accuracy "
        f"{results['held_out_greedy_accuracy']:.3f}, sampled accuracy {results['held_out_sampled_accuracy']:.3f}"
    )
    return info


if __name__ == "__main__":
    main()
