"""Which rows decode now: continuous batching of a call's B·G rows under the KV pool's budget.

Rows enter in row order (prompt index × G + completion index) as far as the pool has room for their prefill
and one block more per running row (so the rows that run can take their next blocks for a while); the
others wait and enter as running rows finish and free their blocks. With prefix caching, a group's prompt is
prefilled once into a prompt entry whose blocks its rows share; the entry lives while rows of its group wait
to start, so a group split across admissions still prefills its prompt once.

When a running row needs a block and none is left, prompt entries go first (their rows will prefill the
prompt again), then the row admitted last is preempted: its blocks are freed, and it waits to re-enter by
prefilling its prompt and the tokens it sampled so far, then carries on where it stopped. Sampling is a
function of (seed, row, position), so a preempted row samples exactly what it would have. The row admitted
first is never preempted for a later one, and the budget holds at least one row at its longest (checked
before the call), so every call finishes.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from retrain.inference.sampler.kv_pool import KvPool


@dataclass(eq=False)
class KvSequence:
    """Tokens whose keys and values the pool holds: a row, or a prompt entry its group's rows share.
    `table_row`: its row of the block table; `stored`: tokens written so far, into `blocks` in order."""

    table_row: int
    prompt: int
    blocks: list[int] = field(default_factory=list)
    stored: int = 0


@dataclass(eq=False)
class Row(KvSequence):
    """One completion of the call; `generated`: tokens sampled so far (its next one is at that position)."""

    generated: int = 0


@dataclass(eq=False)
class PromptEntry(KvSequence):
    """A prompt prefilled once for the rows of its group (prefix caching)."""

    logits: torch.Tensor | None = None  # [V] next-token logits after the prompt: every row's first draw


@dataclass
class Admission:
    """Rows that enter the batch, and the forwards that must run first."""

    entries: list[PromptEntry]  # new prompt entries: prefill their prompts
    attached: list[tuple[Row, PromptEntry]]  # fresh rows sharing an entry's blocks: they draw from its logits
    prefilled: list[Row]  # rows that prefill their prompt and the tokens they sampled before being preempted

    def __bool__(self) -> bool:
        return bool(self.entries or self.attached or self.prefilled)


class Scheduler:
    """The rows of one sampling call and their blocks; see the module docstring."""

    def __init__(
        self,
        pool: KvPool,
        prompt_lengths: list[int],
        group_size: int,
        max_tokens: int,
        prefix_caching: bool,
        device: torch.device,
    ) -> None:
        self.pool = pool
        self.prompt_lengths = prompt_lengths
        self.prefix_caching = prefix_caching
        self.max_tokens = max_tokens
        rows = len(prompt_lengths) * group_size
        self.rows = [Row(table_row=index, prompt=index // group_size) for index in range(rows)]
        self.entries: dict[int, PromptEntry] = {}
        self.fresh_waiting = [group_size] * len(prompt_lengths)  # rows of each group that have not started
        self.waiting = list(range(rows))  # a heap of row indices: the earliest row enters first
        self.running: dict[int, Row] = {}  # in admission order: the last is preempted first
        width = self.pool.shape.blocks_for(max(prompt_lengths) + max_tokens)
        self.table = torch.zeros((rows + len(prompt_lengths), width), dtype=torch.long, device=device)
        self._table_updates: list[tuple[int, int, int]] = []  # (table row, position, block) not yet in `table`
        self.rows_waiting_max = 0
        self.preemptions = 0

    def add_rows(self, prompt_lengths: list[int]) -> None:
        """Rows of one completion each, for prompts that join the running call (requests that arrived while it
        decodes); they wait behind the rows waiting now. Only without prefix caching: prompt entries take the
        table rows after the call's rows, which more rows would overlap."""
        if self.prefix_caching:
            raise RuntimeError("rows cannot join a call that caches prompt prefixes")
        first_row, first_prompt = len(self.rows), len(self.prompt_lengths)
        self.prompt_lengths = [*self.prompt_lengths, *prompt_lengths]
        self.fresh_waiting += [1] * len(prompt_lengths)
        for index in range(len(prompt_lengths)):
            row = Row(table_row=first_row + index, prompt=first_prompt + index)
            self.rows.append(row)
            heapq.heappush(self.waiting, row.table_row)
        width = max(self.table.shape[1], self.pool.shape.blocks_for(max(prompt_lengths) + self.max_tokens))
        table = torch.zeros((len(self.rows), width), dtype=self.table.dtype, device=self.table.device)
        table[:first_row, : self.table.shape[1]] = self.table[:first_row]  # no prompt entries to keep
        self.table = table

    def admit(self) -> Admission:
        """Take waiting rows in order while their prefill and one spare block per running row fit."""
        admission = Admission([], [], [])
        while self.waiting:
            row = self.rows[self.waiting[0]]
            attaches = self.prefix_caching and row.generated == 0
            new_entry = attaches and row.prompt not in self.entries
            length = self.prompt_lengths[row.prompt]
            blocks_for = self.pool.shape.blocks_for
            need = (blocks_for(length) if new_entry else 0) + (0 if attaches else blocks_for(length + row.generated))
            if need + len(self.running) + 1 > self.pool.available():
                if self.running or not self.entries:
                    break
                self._drop_entries(keep=row.prompt if len(self.entries) > 1 else None)  # nothing runs: make room
                continue
            heapq.heappop(self.waiting)
            if new_entry:
                entry = PromptEntry(table_row=len(self.rows) + row.prompt, prompt=row.prompt)
                self._extend(entry, self.pool.shape.blocks_for(length))
                self.entries[row.prompt] = entry
                admission.entries.append(entry)
            if attaches:
                entry = self.entries[row.prompt]
                self.pool.share(entry.blocks)
                self._set_blocks(row, list(entry.blocks))
                row.stored = length
                admission.attached.append((row, entry))
                self.fresh_waiting[row.prompt] -= 1
                if self.fresh_waiting[row.prompt] == 0:
                    self._drop_entry(row.prompt)  # its rows hold its blocks now
            else:
                self._extend(row, self.pool.shape.blocks_for(length + row.generated))
                admission.prefilled.append(row)
                if row.generated == 0:
                    self.fresh_waiting[row.prompt] -= 1
            self.running[row.table_row] = row
        self.rows_waiting_max = max(self.rows_waiting_max, len(self.waiting))
        return admission

    def make_room(self, rows: list[Row], tokens: int = 1) -> list[Row]:
        """Room in each of `rows` (running) for `tokens` more tokens, the first in a block it holds alone; returns
        the rows that still run, in order (the others were preempted to make room)."""
        rows = list(rows)
        while True:
            need = sum(self._blocks_to_write(row, tokens) for row in rows)
            if need <= self.pool.available():
                break
            if self.entries:
                self._drop_entries(keep=None)
                continue
            last = next(reversed(self.running.values()))
            self._preempt(last)
            rows = [row for row in rows if row is not last]
        sources: list[int] = []
        targets: list[int] = []
        for row in rows:
            position = row.stored // self.pool.shape.block_tokens
            if position < len(row.blocks) and self.pool.shared(row.blocks[position]):  # copy on write: a prompt
                (copy,) = self.pool.take(1)  # block the group shares
                sources.append(row.blocks[position])
                targets.append(copy)
                self.pool.release([row.blocks[position]])
                row.blocks[position] = copy
                self._table_updates.append((row.table_row, position, copy))
            if self.pool.shape.blocks_for(row.stored + tokens) > len(row.blocks):
                self._extend(row, self.pool.shape.blocks_for(row.stored + tokens))
        self.pool.copy(sources, targets)
        return rows

    def finish(self, row: Row) -> None:
        """`row` is done: its blocks go back to the pool."""
        self.pool.release(row.blocks)
        row.blocks = []
        del self.running[row.table_row]

    def table_rows(self, sequences: Sequence[KvSequence], index: torch.Tensor | None = None) -> torch.Tensor:
        """[R, blocks] block tables of `sequences`, with every block taken so far; `index`: their table rows on
        the device, when the caller has them."""
        table = self.block_tables()
        if index is None:
            index = torch.tensor([sequence.table_row for sequence in sequences], device=table.device)
        return table[index]

    def block_tables(self) -> torch.Tensor:
        """[table rows, blocks] every sequence's block table, with every block taken so far."""
        if self._table_updates:
            rows, positions, blocks = torch.tensor(self._table_updates, device=self.table.device).unbind(-1)
            self.table.index_put_((rows, positions), blocks)  # one copy from the host, not two
            self._table_updates.clear()
        return self.table

    def _blocks_to_write(self, row: Row, tokens: int) -> int:
        position = row.stored // self.pool.shape.block_tokens
        shared = position < len(row.blocks) and self.pool.shared(row.blocks[position])
        return max(0, self.pool.shape.blocks_for(row.stored + tokens) - len(row.blocks)) + int(shared)

    def _preempt(self, row: Row) -> None:
        self.pool.release(row.blocks)
        row.blocks, row.stored = [], 0
        del self.running[row.table_row]
        heapq.heappush(self.waiting, row.table_row)
        self.preemptions += 1

    def _extend(self, sequence: KvSequence, blocks: int) -> None:
        """`sequence` holds `blocks` blocks: new ones taken from the pool after those it has."""
        new = self.pool.take(blocks - len(sequence.blocks))
        self._set_blocks(sequence, sequence.blocks + new)

    def _set_blocks(self, sequence: KvSequence, blocks: list[int]) -> None:
        start = len(sequence.blocks)
        sequence.blocks = blocks
        self._table_updates.extend((sequence.table_row, i, blocks[i]) for i in range(start, len(blocks)))

    def _drop_entries(self, keep: int | None) -> None:
        for prompt in [prompt for prompt in self.entries if prompt != keep]:
            self._drop_entry(prompt)

    def _drop_entry(self, prompt: int) -> None:
        self.pool.release(self.entries.pop(prompt).blocks)
