"""The training forward with each group packed into one row: its prompt once, then its completions.

A group's completions share their prompt, so the trainer runs each prompt once. It can do so in two
ways. The KV-cache way (retrain/model/logprobs.py) runs the prompts as a prefill, repeats each
prompt's keys and values for its rows and runs every row's completion after it: two forwards, plus a
copy of the prompt cache per row whose backward sums it back. Packed, a group is one row,

    prompt | completion 1 | completion 2 | ... | completion n

with a mask that lets a completion token see its prompt and the tokens before it in its own completion,
and nothing of the others: one forward over the same tokens, and a completion token's logits are those
of the KV-cache way up to fp32 rounding (the attention sums over a longer, masked key row). On a small
model, whose step is mostly the cost of each op rather than its arithmetic, it takes a quarter off the
training step (docs/benchmarks.md, change 14).

The price is attention over the whole packed row, L = prompt + n × completion width tokens, most of it
masked: G × L² scores per head and layer, where the KV-cache way computes G × prompt² + R × width ×
(prompt + width), and a G × L² mask (floats inside sdpa). Packing pays while the scores it adds cost less
than the forward and the copies it saves. Measured on small64's model (docs/benchmarks.md, change 14) with
completions of 8, 16, 32 and 64 tokens, the training step took 14% less at 2.4× the KV-cache way's scores,
8% less at 3.4×, the same at 4.7× and 15% more at 5.9×; the tiny Qwen3's, at ~2.7×, 25% less.
`packed_hidden` packs up to PACKED_SCORE_RATIO times the KV-cache way's scores and PACKED_MASK_LIMIT mask
entries, with a model that runs its lean forward (which takes such masks); otherwise it returns None and
the trainer takes the KV-cache way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retrain.model.lean_decoder import LeanForward
from retrain.model.rows import positions_from_mask, rows_of

PACKED_SCORE_RATIO = 4  # packed attention scores per KV-cache-way score, at most
PACKED_MASK_LIMIT = 1 << 24  # G × L² entries: 64 MiB as the float mask sdpa makes of it


@dataclass(frozen=True)
class PackedGroups:
    """Where each row's completion sits in its group's packed row."""

    slot: torch.Tensor  # [R] the row's place among its group's completions
    groups: int
    prompt_width: int
    slots: int  # completions per packed row (the largest group; smaller groups leave slots empty)
    width: int  # tokens per slot: the completion width less its last token, which predicts nothing

    @classmethod
    def of(cls, prompt_index: torch.Tensor, prompt_width: int, groups: int, completion_width: int) -> PackedGroups:
        index = prompt_index.cpu()  # one number per row; bincount has no deterministic CUDA kernel
        counts = torch.bincount(index, minlength=groups)
        order = index.argsort(stable=True)
        first_row_of_group = counts.cumsum(0) - counts
        slot = torch.empty_like(index)
        slot[order] = torch.arange(len(order)) - first_row_of_group[index[order]]
        return cls(slot.to(prompt_index.device), groups, prompt_width, int(counts.max()), completion_width - 1)

    @property
    def length(self) -> int:
        return self.prompt_width + self.slots * self.width

    def pays(self) -> bool:
        """Packing computes few enough attention scores, with a small enough mask, to be the faster way."""
        packed = self.groups * self.length**2
        kv_cache_way = self.groups * self.prompt_width**2 + len(self.slot) * self.width * (
            self.prompt_width + self.width
        )
        return packed <= PACKED_MASK_LIMIT and packed <= PACKED_SCORE_RATIO * kv_cache_way

    def columns(self) -> torch.Tensor:
        """[R, width] where each row's input tokens go in its group's packed row."""
        offsets = torch.arange(self.width, device=self.slot.device)
        return self.prompt_width + self.slot.unsqueeze(1) * self.width + offsets

    def positions(self, prompt_mask: torch.Tensor) -> torch.Tensor:
        """[G, L] position ids: the prompt's among its real tokens, a slot's continuing from the prompt's end."""
        in_slot = torch.arange(self.width, device=prompt_mask.device).repeat(self.slots)
        return torch.cat([positions_from_mask(prompt_mask), prompt_mask.sum(dim=1, keepdim=True) + in_slot], dim=1)

    def tokens(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        prompt_index: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[G, L] input ids of the packed rows and which of them are real tokens (not padding), from
        completion_logprobs' arguments."""
        groups, prompt_width = prompt_ids.shape
        input_ids = prompt_ids.new_zeros((groups, self.length))
        real = prompt_mask.new_zeros((groups, self.length))
        input_ids[:, :prompt_width], real[:, :prompt_width] = prompt_ids, prompt_mask
        group_of_row, columns = prompt_index.unsqueeze(1), self.columns()
        input_ids[group_of_row, columns] = completion_ids[:, :-1]
        real[group_of_row, columns] = completion_mask[:, :-1]
        return input_ids, real

    def segments(self) -> torch.Tensor:
        """[L] each column's part of its row: 0 the prompt, s the s-th slot."""
        segment = torch.zeros(self.length, dtype=torch.long, device=self.slot.device)
        segment[self.prompt_width :] = torch.arange(1, self.slots + 1, device=self.slot.device).repeat_interleave(
            self.width
        )
        return segment

    def attends(self) -> torch.Tensor:
        """[L, L] which position may see which, padding aside: itself and the positions before it in the
        prompt or in its own slot."""
        segment = self.segments()
        position = torch.arange(self.length, device=self.slot.device)
        causal = position.unsqueeze(0) <= position.unsqueeze(1)
        same_or_prompt = (segment.unsqueeze(0) == 0) | (segment.unsqueeze(0) == segment.unsqueeze(1))
        return causal & same_or_prompt

    def kept(self, completion_width: int) -> torch.Tensor:
        """[R, T] which of the kept logits (the prompt's last position, then every slot position) predicts each
        completion token: the first from the prompt's end, the rest from the slot's tokens before them."""
        offsets = torch.arange(completion_width, device=self.slot.device)
        return torch.where(offsets == 0, 0, self.slot.unsqueeze(1) * self.width + offsets)


def packed_hidden(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, PackedGroups] | None:
    """[R, T, hidden] last hidden states that predict every completion token (the LM head's input; see
    `causal_lm_hidden`), from one forward of packed groups (see the module docstring), and their layout; or None
    where packing does not apply. Arguments as completion_logprobs takes them; every prompt has at least one row."""
    lean = LeanForward.of(model)
    if lean is None:
        return None
    groups, prompt_width = prompt_ids.shape
    packing = PackedGroups.of(prompt_index, prompt_width, groups, completion_ids.shape[1])
    if not packing.pays():
        return None
    input_ids, real = packing.tokens(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
    mask = (packing.attends() & real[:, None, :]).unsqueeze(1)
    hidden = lean.hidden(input_ids, mask, packing.positions(prompt_mask), None, keep=1 + packing.slots * packing.width)
    kept = packing.kept(completion_ids.shape[1])
    flat = prompt_index.unsqueeze(1) * hidden.shape[1] + kept
    return rows_of(hidden.flatten(0, 1), flat.flatten()).view(*kept.shape, -1), packing
