"""The decode loop of one sampling call: admit rows, prefill them, sample, decode, until every row is done.

Each iteration admits the rows the scheduler lets in (prefilled in forwards of at most PREFILL_TOKENS padded
tokens: a long prompt batch, or one long prompt, goes in pieces), draws one token for every running row from
its logits, retires the rows that emitted a stop token or reached max_tokens (their blocks return to the
pool), and runs one decode forward over the rest. A row's token at position p is drawn with the uniform of
(seed, row, p), so what it samples never depends on which rows share its forwards. Rows may also join a running
call (the endpoint's requests, `arrivals`), and each finished row can be reported at once (`on_finish`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from retrain.inference.sampler.kv_budget import GIB
from retrain.inference.sampler.kv_pool import KvPool
from retrain.inference.sampler.paged_cache import PagedCache, plan_forward
from retrain.inference.sampler.scheduler import KvSequence, PromptEntry, Row, Scheduler
from retrain.inference.sampler.step_graphs import Recorder, StepGraphs
from retrain.inference.sampler.tokens import choose_tokens
from retrain.model.lean_decoder import LeanForward, causal_lm_logits
from retrain.types import SamplingParams

PREFILL_TOKENS = 8192  # padded tokens per prefill forward: bounds its activations whatever the prompts
# decode steps between reads of the stop flags on a GPU (`Window`): a read per step would stall the launch queue
# once a token; 8 wastes at most 7 tokens of a row that stopped, and reports it (`on_finish`) at most 7 steps late
GPU_STOP_CHECK_STEPS = 8

# a finished row's index, its sampled ids and their log-probs ([generated] each), and whether it met a stop token
Finished = Callable[[int, torch.Tensor, torch.Tensor, bool], None]


class Decoded(NamedTuple):
    """Per-row results of the decode loop, [N, max_tokens] on the engine's device, and the loop's statistics."""

    ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor | None
    kept_mass: torch.Tensor
    finished: torch.Tensor  # [N] stopped at a stop token
    metrics: dict[str, float]


@dataclass
class Prompts:
    """The call's left-padded [B, P] prompts and what the loop needs of them; `arrived`: the prompts of rows that
    joined the running call (one row each), numbered after the B."""

    ids: torch.Tensor
    lengths: list[int]
    group_size: int
    arrived: list[torch.Tensor] = field(default_factory=list)

    def tokens(self, row: Row | PromptEntry) -> torch.Tensor:
        if row.prompt >= len(self.ids):
            return self.arrived[row.prompt - len(self.ids)]
        return self.ids[row.prompt, self.ids.shape[1] - self.lengths[row.prompt] :]


@dataclass
class Arrival:
    """A row that joins a running call (a request that came while it decodes): its prompt ([P] on the device), its
    max_tokens (at most the call's) and its uniforms ([call's max_tokens]; None at T = 0)."""

    prompt: torch.Tensor
    limit: int
    uniforms: torch.Tensor | None


Arrivals = Callable[[], list[Arrival]]  # the rows that arrived since the last call (none: [])


def decode(
    model: Any,
    pool: KvPool,
    layer_types: list[str] | None,
    prompts: Prompts,
    sampling: SamplingParams,
    uniforms: torch.Tensor | None,
    stop_ids: torch.Tensor,
    pad_id: int,
    prefix_caching: bool,
    limits: list[int] | None = None,
    on_finish: Finished | None = None,
    arrivals: Arrivals | None = None,
    stop_check_steps: int = 1,
    paged_attention: bool = False,
    record: Recorder | None = None,
) -> Decoded:
    """Sample every row of the call; `uniforms`: [N, max_tokens] (None at T = 0). `limits`: each row's own
    max_tokens, at most sampling.max_tokens (the requests of a batch each ask their own; None: all the same).
    `on_finish(row, ids, logprobs, stopped)` is called as each row finishes, while the others still decode (the
    endpoint answers a request then, not when its whole batch is done). `arrivals()` is asked before every window
    for rows that join the call (needs prefix caching off); they are numbered after the call's rows, wait behind
    the rows waiting already, and the call ends when no row runs, waits or arrives. `stop_check_steps`: decode
    steps between the host's reads of which rows met a stop token (see `Window`). `paged_attention`: attention reads
    cached keys from the pool through the block tables (paged_attention.py), where the model's forward is the lean
    one; else from a gathered copy. `record`: decode forwards are recorded once per row bucket and replayed
    (step_graphs.py: CUDA graphs), where attention reads the pool (the pool needs its sink block)."""
    device = prompts.ids.device
    rows, steps = len(prompts.lengths) * prompts.group_size, sampling.max_tokens
    limit = list(limits) if limits is not None else [steps] * rows
    ids = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    kept_mass = torch.ones((rows, steps), dtype=torch.float32, device=device)
    entropies = torch.zeros((rows, steps), dtype=torch.float32, device=device) if sampling.return_entropies else None
    stopped_rows: set[int] = set()
    scheduler = Scheduler(pool, prompts.lengths, prompts.group_size, steps, prefix_caching, device)
    flex = paged_attention and LeanForward.of(model) is not None
    cache = PagedCache(pool, layer_types)
    graphs = StepGraphs(model, cache, pad_id, record) if flex and record is not None else None
    forward = Forward(model, cache, scheduler, pad_id, flex, graphs)

    running: list[Row] = []  # rows whose next-token logits are `logits`, in order
    logits: list[torch.Tensor] = []
    steady: RunningTensors | None = None  # `running`'s tensors, in order; None when rows entered
    joined: list[Arrival] = []  # rows that arrived during the last window, which they cut short
    while True:
        if not joined and arrivals is not None:
            joined = arrivals()
        if joined:
            grown = len(joined)
            ids = _more_rows(ids, grown, pad_id)
            logprobs, kept_mass = _more_rows(logprobs, grown, 0.0), _more_rows(kept_mass, grown, 1.0)
            entropies = None if entropies is None else _more_rows(entropies, grown, 0.0)
            if uniforms is not None:
                uniforms = torch.cat([uniforms, *(_drawn(arrival).unsqueeze(0) for arrival in joined)])
            prompts.arrived += [arrival.prompt for arrival in joined]
            limit += [arrival.limit for arrival in joined]
            scheduler.add_rows([len(arrival.prompt) for arrival in joined])
            joined = []
        admission = scheduler.admit()
        if admission:
            steady = None
            for entry, entry_logits in zip(
                admission.entries, forward.prefill(admission.entries, [prompts.tokens(e) for e in admission.entries])
            ):
                entry.logits = entry_logits
            if admission.attached:
                running += [row for row, _ in admission.attached]
                logits.append(torch.stack([_logits_of(entry) for _, entry in admission.attached]))
            if admission.prefilled:
                known = [
                    torch.cat([prompts.tokens(row), ids[row.table_row, : row.generated]]) for row in admission.prefilled
                ]
                running += admission.prefilled
                logits.append(torch.stack(forward.prefill(admission.prefilled, known)))
        if not running:
            if scheduler.waiting:
                raise RuntimeError("no row runs and none can enter: the KV budget check should have refused this call")
            break
        width = min(stop_check_steps, *(limit[row.table_row] - row.generated for row in running))
        next_logits = torch.cat(logits)
        kept = scheduler.make_room(running, width - 1) if width > 1 else running  # the window's forwards but
        if len(kept) < len(running):  # its last, which makes its own room
            index = _positions_of(kept, running, device)
            next_logits, steady = next_logits[index], None if steady is None else steady.of(index)
            running = kept
        if steady is None:
            steady = RunningTensors.of_rows(running, device)
        window = Window(running, steady, torch.full((len(running),), steps, device=device))
        for at in range(width):
            draws = None if uniforms is None else uniforms[window.tensors.table_rows, window.tensors.position]
            choice = choose_tokens(next_logits, sampling, draws, entropies is not None)
            where = (window.tensors.table_rows, window.tensors.position)
            ids[where] = choice.tokens
            logprobs[where] = choice.logprobs
            kept_mass[where] = choice.kept_mass
            if entropies is not None and choice.entropies is not None:
                entropies[where] = choice.entropies
            window.record_stops(choice.tokens, stop_ids)
            if at == width - 1 or (arrivals is not None and (joined := arrivals())):
                break  # rows that arrive enter at once, not at the window's end
            next_logits = forward.decode(running, choice.tokens, window.tensors)
            window.forwarded()
        going: list[Row] = []
        for row, stop in window.ends():  # the window's one host read
            if stop is not None or row.generated == limit[row.table_row]:
                if stop is not None:
                    row.generated = stop
                    stopped_rows.add(row.table_row)
                scheduler.finish(row)
                if on_finish is not None:
                    at_row = row.table_row
                    on_finish(at_row, ids[at_row, : row.generated], logprobs[at_row, : row.generated], stop is not None)
            else:
                going.append(row)
        running, logits = [], []
        if going:
            kept = scheduler.make_room(going)
            tokens, steady = choice.tokens, window.tensors
            if len(kept) < len(window.rows):  # rows left or were preempted: the others' tensors carry over
                index = _positions_of(kept, window.rows, device)
                tokens, steady = tokens[index], steady.of(index)
            running, logits = kept, [forward.decode(kept, tokens, steady)]
            steady = steady.forwarded()
    if graphs is not None:
        graphs.release()
    generated = torch.tensor([row.generated for row in scheduler.rows], device=device)
    mask = torch.arange(steps, device=device) < generated.unsqueeze(-1)
    ids.masked_fill_(~mask, pad_id)  # what rows drew after their stop, while the host did not know yet
    logprobs.masked_fill_(~mask, 0.0)
    kept_mass.masked_fill_(~mask, 1.0)
    if entropies is not None:
        entropies.masked_fill_(~mask, 0.0)
    finished = torch.tensor([row.table_row in stopped_rows for row in scheduler.rows], device=device)
    metrics = {
        "engine/kv_peak_gb": pool.peak_in_use * pool.shape.block_bytes / GIB,
        "engine/kv_reserved_gb": pool.peak_capacity * pool.shape.block_bytes / GIB,
        "engine/rows_waiting_max": float(scheduler.rows_waiting_max),
        "engine/preemptions": float(scheduler.preemptions),
        "engine/forwards": float(forward.forwards),
    }
    return Decoded(ids, mask, logprobs, entropies, kept_mass, finished, metrics)


class RunningTensors(NamedTuple):
    """The running rows' table rows, the positions of their next draws and their lengths once the next forward
    stored its token ([R] each, on the device). They move on on the device step after step, follow the rows that
    stay when others leave, and are built from host data only when rows enter: a decode step builds none."""

    table_rows: torch.Tensor
    position: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def of_rows(cls, rows: list[Row], device: torch.device) -> RunningTensors:
        """The tensors of `rows` as the host knows them, in one copy from the host."""
        values = torch.tensor([[row.table_row, row.generated, row.stored + 1] for row in rows], device=device)
        return cls(*values.unbind(-1))

    def of(self, index: torch.Tensor) -> RunningTensors:
        """The tensors of the rows at `index`."""
        return RunningTensors(*(tensor[index] for tensor in self))

    def drawn(self) -> RunningTensors:
        return self._replace(position=self.position + 1)

    def forwarded(self) -> RunningTensors:
        return self._replace(lengths=self.lengths + 1)


@dataclass
class Window:
    """A run of decode steps between two reads of the stop flags, over the same rows.

    Reading which rows drew a stop token makes the host wait for the device; on a GPU that wait, once a step,
    costs more than a small model's step. So the flags stay on the device for up to `stop_check_steps` steps (and
    at most each row's remaining max_tokens, so that no row passes its limit; rows that arrive end the window at
    once): a row that stopped draws on until the window ends, what it draws then is cleared when the call ends,
    and its blocks had room made for the whole window beforehand."""

    rows: list[Row]
    tensors: RunningTensors
    stop_at: torch.Tensor  # [R] each row's first stop token's position; max_tokens while it has none
    steps: int = 0  # drawn so far

    def record_stops(self, tokens: torch.Tensor, stop_ids: torch.Tensor) -> None:
        """The step's draws `tokens` ([R]) are in: note who stopped, move on to the next positions."""
        stopped = torch.isin(tokens, stop_ids)
        self.stop_at = torch.where(stopped, torch.minimum(self.stop_at, self.tensors.position), self.stop_at)
        self.tensors = self.tensors.drawn()
        self.steps += 1

    def forwarded(self) -> None:
        self.tensors = self.tensors.forwarded()

    def ends(self) -> list[tuple[Row, int | None]]:
        """Each row with the tokens it generated up to its stop token (None: no stop yet); rows' `generated`
        move on by the window's steps."""
        stops = self.stop_at.tolist()
        for row in self.rows:
            row.generated += self.steps
        return [(row, stop + 1 if stop < row.generated else None) for row, stop in zip(self.rows, stops, strict=True)]


def _positions_of(rows: list[Row], among: list[Row], device: torch.device) -> torch.Tensor:
    """Where each of `rows` is in `among` (an index for the tensors laid out as `among`)."""
    at = {id(row): index for index, row in enumerate(among)}
    return torch.tensor([at[id(row)] for row in rows], device=device)


def _more_rows(tensor: torch.Tensor, rows: int, fill: float | bool) -> torch.Tensor:
    """`tensor` ([N, ...]) with `rows` more rows of `fill` at the end."""
    return torch.cat([tensor, torch.full((rows, *tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)])


def _drawn(arrival: Arrival) -> torch.Tensor:
    if arrival.uniforms is None:
        raise ValueError("a row that joins a call at temperature > 0 needs its uniforms")
    return arrival.uniforms


def _logits_of(entry: PromptEntry) -> torch.Tensor:
    if entry.logits is None:
        raise RuntimeError(f"prompt {entry.prompt}'s entry was not prefilled")
    return entry.logits


@dataclass
class Forward:
    """The model's forwards over the paged cache: prefills in bounded pieces, and decode steps."""

    model: Any
    cache: PagedCache
    scheduler: Scheduler
    pad_id: int
    paged_attention: bool = False  # attention reads the pool through the block tables (see `decode`)
    graphs: StepGraphs | None = None  # decode steps replay recorded graphs
    forwards: int = 0  # forwards run (prefill pieces, decode steps, replays): each reads every weight once

    def prefill(self, sequences: Sequence[KvSequence], tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Store `tokens` (one 1-D tensor per sequence, after the `stored` ones it shares) in each sequence's
        blocks; returns each sequence's [V] next-token logits. At most PREFILL_TOKENS padded tokens a forward."""
        done = [0] * len(sequences)
        out: list[torch.Tensor | None] = [None] * len(sequences)
        pending = list(range(len(sequences)))
        while pending:
            batch: list[int] = []
            width = 0
            for index in pending:
                size = min(len(tokens[index]) - done[index], PREFILL_TOKENS)
                if batch and max(width, size) * (len(batch) + 1) > PREFILL_TOKENS:
                    break
                batch.append(index)
                width = max(width, size)
            pieces = [tokens[i][done[i] : done[i] + width] for i in batch]
            device = pieces[0].device
            new = torch.full((len(batch), width), self.pad_id, dtype=torch.long, device=device)
            real = torch.zeros((len(batch), width), dtype=torch.bool, device=device)
            for at, piece in enumerate(pieces):
                new[at, width - len(piece) :] = piece
                real[at, width - len(piece) :] = True
            lengths = [sequences[i].stored + len(piece) for i, piece in zip(batch, pieces, strict=True)]
            all_real = all(len(piece) == width for piece in pieces)
            batch_logits = self._forward([sequences[i] for i in batch], lengths, new, None if all_real else real)
            for at, (index, piece) in enumerate(zip(batch, pieces, strict=True)):
                sequences[index].stored += len(piece)
                done[index] += len(piece)
                if done[index] == len(tokens[index]):
                    out[index] = batch_logits[at]
            pending = [index for index in pending if done[index] < len(tokens[index])]
        return [logits for logits in out if logits is not None]  # every sequence ran to its end

    def decode(self, rows: list[Row], tokens: torch.Tensor, steady: RunningTensors) -> torch.Tensor:
        """[R, V] next-token logits after feeding each row its sampled token `tokens` ([R]); `steady`: the rows'
        tensors on the device."""
        if self.graphs is not None:
            logits = self.graphs.logits(self.scheduler.block_tables(), steady.table_rows, steady.lengths, tokens)
            self.forwards += 1
        else:
            lengths = [row.stored + 1 for row in rows]
            logits = self._forward(rows, lengths, tokens.unsqueeze(-1), None, steady)
        for row in rows:
            row.stored += 1
        return logits

    def _forward(
        self,
        sequences: Sequence[KvSequence],
        lengths: list[int],
        new: torch.Tensor,
        real: torch.Tensor | None,
        steady: RunningTensors | None = None,
    ) -> torch.Tensor:
        table = self.scheduler.table_rows(sequences, None if steady is None else steady.table_rows)
        on_device = torch.tensor(lengths, device=new.device) if steady is None else steady.lengths
        pool_blocks = self.cache.pool.capacity if self.paged_attention else None
        block_tokens = self.cache.pool.shape.block_tokens
        plan = plan_forward(table, on_device, (min(lengths), max(lengths)), new, real, block_tokens, pool_blocks)
        self.cache.plan = plan
        self.forwards += 1
        logits = causal_lm_logits(
            self.model,
            plan.input_ids,
            plan.attention_mask,
            plan.position_ids,
            self.cache,
            logits_to_keep=1,
            padded=plan.padded,
        )
        return logits[:, -1]
