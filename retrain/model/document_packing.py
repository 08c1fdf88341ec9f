"""The training forward with every row's real tokens back to back in one sequence, attended through flex_attention.

packing.py packs each group into one padded row (prompt | completion 1 | completion 2 | ...) and hands sdpa a
dense [G, 1, L, L] mask: sdpa then computes every masked score (G × L² per head and layer), and on a GPU a
masked call cannot take grouped-query attention, so its key and value heads are repeated for the query heads.
Here the padding goes too: the groups' rows are laid end to end, their padding dropped, into one sequence of N
tokens. Each token belongs to a document (its group) and a segment (0: the group's prompt, s: its s-th completion); a token sees the tokens of its document at
or before it that are its prompt's or its own segment's. A BlockMask lists, per 128-token query block, the key
blocks where any of that holds (built from the segments' extents, never from an N × N mask), and flex_attention,
compiled, computes those blocks only, the key/value heads shared by their query heads (`enable_gqa`). A completion
token's hidden states are the KV-cache way's and the packed way's, up to fp32 rounding. Only attention pads:
its queries, keys and values are padded at the end to a `bucket` of few lengths, so that a GPU compiles few
kernels (a padding position sees itself alone: the diagonal blocks); the linears and the MLP run on the N real
tokens.

flex_attention has no backward on the CPU: there the trainer keeps packing.py's and logprobs.py's layouts
(`backend.train_attention`), and the CPU's tests check this layout's mask (as a dense mask through sdpa, with
gradients) and its flex forward (eager and compiled) against them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils._triton import has_triton

from retrain.errors import ConfigError
from retrain.model.lean_decoder import MIRRORED, LeanForward, causal_lm_of, mirrored
from retrain.model.packing import PackedGroups
from retrain.model.rows import rows_of

BLOCK = 128  # flex_attention's query and key tile
BUCKETS_PER_OCTAVE = 4  # lengths a kernel is compiled for: 128 × {1, ..., 8, 10, 12, 14, 16, 20, ...}; < 25% padding
RECOMPILE_LIMIT = 64  # kernels per process (dynamo's default, 8, would drop later lengths to eager flex)


def bucket(tokens: int) -> int:
    """The sequence length a forward of `tokens` real tokens runs at: whole BLOCKs, BUCKETS_PER_OCTAVE lengths per
    doubling, so that a run's lengths compile few kernels (~20 from 128 to 10,240 tokens)."""
    blocks = max(1, -(-tokens // BLOCK))
    step = max(1, (1 << (blocks.bit_length() - 1)) // BUCKETS_PER_OCTAVE)  # blocks between lengths in this octave
    return -(-blocks // step) * step * BLOCK


@dataclass(frozen=True)
class DocumentPacking:
    """Where each real token of a forward's rows sits in the packed sequence, and which tokens it sees."""

    input_ids: torch.Tensor  # [1, N] the real tokens
    position_ids: torch.Tensor  # [1, N]
    document: torch.Tensor  # [L] the token's group, over the attention's `bucket(N)` positions: its padding is one more
    segment: torch.Tensor  # [L] 0: a prompt token, s: a token of its group's s-th completion, < 0: padding (itself)
    predicting: torch.Tensor  # [R, T] the packed position whose hidden states predict each completion token

    @classmethod
    def of(
        cls,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        prompt_index: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> DocumentPacking:
        """The packing of completion_logprobs' arguments: packing.py's group rows with their padding dropped."""
        groups, prompt_width = prompt_ids.shape
        completion_width = completion_ids.shape[1]
        layout = PackedGroups.of(prompt_index, prompt_width, groups, completion_width)
        input_ids, real = layout.tokens(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
        kept = real.flatten().nonzero().squeeze(1)  # group by group: its prompt, then its completions in order
        tokens = len(kept)
        padding = bucket(tokens) - tokens
        predicting_column = prompt_width - 1 + layout.kept(completion_width)  # the prompt's last, then the slot's
        packed_position = real.flatten().long().cumsum(0) - 1  # a real token's place among the kept ones
        predicting = packed_position[prompt_index.unsqueeze(1) * layout.length + predicting_column]
        return cls(
            input_ids=input_ids.flatten()[kept].unsqueeze(0),
            position_ids=layout.positions(prompt_mask).flatten()[kept].unsqueeze(0),
            document=F.pad(kept // layout.length, (0, padding), value=groups),
            segment=torch.cat(
                [layout.segments()[kept % layout.length], -torch.arange(1, padding + 1, device=kept.device)]
            ),
            predicting=predicting.clamp(min=0),
        )

    @property
    def tokens(self) -> int:
        """N: the real tokens, the positions the forward's linears compute."""
        return self.input_ids.shape[1]

    @property
    def length(self) -> int:
        """L: the positions attention computes, N padded to a `bucket`."""
        return self.document.shape[0]

    def mask_mod(self) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """flex_attention's mask function: a key is seen where it is the query's document's, not after the query, and
        its prompt's or the query's own completion's."""
        document, segment = self.document, self.segment

        def visible(batch: torch.Tensor, head: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
            same_part = (segment[key] == 0) | (segment[key] == segment[query])
            return (document[key] == document[query]) & (key <= query) & same_part

        return visible

    def block_mask(self) -> BlockMask:
        """The BlockMask of `mask_mod`: a key block is listed for a query block where a segment of the query block
        sees into it (its prompt, or its own extent up to the block's end); causal blocks only."""
        blocks = self.length // BLOCK
        starts, ends, sees_from, sees_to = self._runs()
        first_query, last_query = starts // BLOCK, (ends - 1) // BLOCK
        block = torch.arange(blocks, device=starts.device)
        queries = (block >= first_query.unsqueeze(1)) & (block <= last_query.unsqueeze(1))  # [runs, blocks]
        keys = (block >= (sees_from // BLOCK).unsqueeze(1)) & (block <= ((sees_to - 1) // BLOCK).unsqueeze(1))
        listed = (queries.T.float() @ keys.float() > 0) & (block.unsqueeze(1) >= block)  # [query block, key block]
        counts = listed.sum(dim=1, dtype=torch.int32)
        order = listed.to(torch.int8).argsort(dim=1, descending=True, stable=True).to(torch.int32)
        return BlockMask.from_kv_blocks(
            counts.view(1, 1, blocks), order.view(1, 1, blocks, blocks), BLOCK_SIZE=BLOCK, mask_mod=self.mask_mod()
        )

    def _runs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per run of one (document, segment): where it starts and ends, and each key range its queries see (two
        per completion run: the prompt's extent and its own; a prompt run, or a padding token, sees its own)."""
        change = torch.ones(self.length, dtype=torch.bool, device=self.document.device)
        change[1:] = (self.document[1:] != self.document[:-1]) | (self.segment[1:] != self.segment[:-1])
        starts = change.nonzero().squeeze(1)
        ends = torch.cat([starts[1:], starts.new_tensor([self.length])])
        completion, prompt = self.segment[starts] > 0, self.segment[starts] == 0
        prompt_run = torch.cumsum(prompt, 0) - 1  # each run's document's prompt run (a group starts with it)
        prompt_starts, prompt_ends = starts[prompt], ends[prompt]
        sees_prompt = (prompt_starts[prompt_run], prompt_ends[prompt_run])
        return (
            torch.cat([starts, starts[completion]]),
            torch.cat([ends, ends[completion]]),
            torch.cat([starts, sees_prompt[0][completion]]),
            torch.cat([ends, sees_prompt[1][completion]]),
        )


def trains_with_documents(mode: str, model: Any, device: torch.device) -> bool:
    """Whether the training forward packs its rows as documents (`backend.train_attention`): flex, or auto where it
    can run. It needs the lean forward (a mirrored model, no attention dropout; checkpointed or not) and
    flex_attention's backward, which runs on a GPU through triton only: auto steps aside, flex is a ConfigError."""
    key = f"backend.train_attention={mode}"
    missing = []
    if not mirrored(model):
        missing.append(
            f"retrain's lean forward, which {model.config.model_type} does not run (it mirrors {', '.join(MIRRORED)})"
        )
    if getattr(causal_lm_of(model).config, "attention_dropout", 0.0):
        missing.append("attention without dropout (flex_attention has none)")
    if device.type != "cuda":
        missing.append(f"flex_attention's backward, which runs on a GPU only (the trainer is on {device.type})")
    elif not has_triton():
        missing.append("triton, which compiles flex_attention's kernels on a GPU (pip install triton)")
    if mode == "flex" and missing:
        raise ConfigError(f"{key} needs {'; and '.join(missing)}; use backend.train_attention=mask")
    return mode == "flex" or (mode == "auto" and not missing)


def document_hidden(
    model: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_index: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[torch.Tensor, DocumentPacking]:
    """[R, T, hidden] last hidden states that predict every completion token (see `causal_lm_hidden`) from one
    flex_attention forward of the rows packed as documents, and the packing (its tokens, for the step's metrics).
    The model runs its lean forward (`LeanForward.of`: the caller checks)."""
    lean = LeanForward.of(model)
    assert lean is not None, "document packing runs retrain's lean forward"
    packing = DocumentPacking.of(prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask)
    block_mask = packing.block_mask()
    flex = _compiled_flex_attention() if prompt_ids.is_cuda else _training_flex  # a GPU's; eager scores every pair
    padding = (0, 0, 0, packing.length - packing.tokens)  # the kernel's positions: few shapes, few compiles

    def attend(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        query, key, value = (F.pad(tensor, padding) for tensor in (query, key, value))
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            output = flex(query, key, value, block_mask, kwargs["scaling"])
        return output[:, :, : packing.tokens].transpose(1, 2).contiguous(), None

    hidden = lean.hidden(packing.input_ids, None, packing.position_ids, None, 0, attend)
    predicting = packing.predicting
    return rows_of(hidden[0], predicting.flatten()).view(*predicting.shape, -1), packing


def _training_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: BlockMask, scale: float
) -> torch.Tensor:
    """flex_attention as the trainer calls it: its own function, so its compiled kernels are counted apart from
    the sampler's (dynamo's recompile limit is per function)."""
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


@functools.cache
def _compiled_flex_attention() -> Any:
    """`_training_flex` compiled per bucketed length, built at first use."""
    return torch.compile(_training_flex, dynamic=False)
