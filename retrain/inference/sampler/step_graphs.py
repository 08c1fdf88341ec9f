"""A sampling call's decode forwards recorded once per row bucket and replayed: on a GPU as CUDA graphs, one
launch a step where the eager forward launches every op (`inference.cuda_graphs`).

An eager decode step of Qwen3-4B launches ~1,500 kernels (docs/benchmarks.md: ~42 ops a layer); at a few µs a
launch the host, not the GPU, sets the pace of a small batch. A CUDA graph records the launches of one step and
replays them in one call, with the addresses and shapes it recorded. So a recorded step reads and writes only
tensors that outlive it, and nothing the host decides inside it may change between replays:

- the rows' inputs are buffers of the bucket's size (`row_bucket`: 8, 16, 32 ... rows) that the host fills before
  each replay (three copies on the device): the sampled tokens, the rows' block tables and their lengths. The
  slots written, the positions and the block mask are computed from them inside the step (`plan_paged_decode`),
  so a replay computes this step's. Attention reads the pool through the block tables (flex), whose shapes do not
  depend on the rows' lengths; the gather path's do, and is never recorded.
- the bucket's rows past the real ones are sink rows: their tables list only the pool's sink block (`KvPool`'s
  `sink`) and they hold one token, so they write their keys and values there and see nothing else; no row's
  blocks are touched. Their logits are dropped.
- the weights, the adapters' compute-dtype copies and the pool are the call's: the graphs live for one call, in
  which none of them changes or moves, and go with it; the next call records again (a bucket's first step runs
  eagerly and is then recorded: about one more step's host time a bucket, and a call meets at most a few).
- the output, the bucket's [rows, vocab] logits, is the graph's own memory: the decode loop draws from it before
  the next forward, as it must (a replay overwrites it).

The draw and the window's bookkeeping stay eager (~20 kernels a step). Every graph of a call shares one memory
pool: they replay one at a time, so a step's intermediates may take the memory another's used; the pool lives as
long as the call's recorder, so nothing of it stays while the trainer runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any, cast

import torch

from retrain.inference.sampler.paged_attention import row_bucket
from retrain.inference.sampler.paged_cache import PagedCache, plan_paged_decode
from retrain.model.lean_decoder import causal_lm_logits

Step = Callable[[], torch.Tensor]
# records a step: runs it once and returns its output and its replay, which computes it again from what the
# tensors it read hold then
Recorder = Callable[[Step], tuple[torch.Tensor, Step]]


def cuda_graph_recorder(device: torch.device) -> Recorder:
    """A Recorder of CUDA graphs on `device` for one sampling call, its graphs sharing one memory pool. The first
    run is torch's warm-up on a side stream (a compiled kernel compiles at its first call, cuBLAS sets up its
    workspace: neither may happen while a graph records). Only this thread is held to what recording allows: a
    trainer's thread may use the device meanwhile (sampling ahead, docs/async.md). `capture_begin`, not
    `torch.cuda.graph`: that one synchronises the device and empties the allocator's cache before every recording,
    which would hand the memory training keeps cached back to CUDA at each bucket of each call. The pool is the
    recorder's: when the call ends its graphs go, then the recorder, and the pool's memory goes back to CUDA with
    it (a graph pool left to the allocator would be freed only by an allocation that fails first: a retry)."""
    with torch.cuda.device(device):
        memory = torch.cuda.MemPool()
    side = recording_stream(device)

    def record(step: Step) -> tuple[torch.Tensor, Step]:
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            first = step()
        current.wait_stream(side)
        first.record_stream(current)  # the caller reads it on the current stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            graph.capture_begin(pool=cast(Any, memory.id), capture_error_mode="thread_local")  # typed as a handle
            try:
                output = step()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is void; the step's error is the one to see
                    graph.capture_end()
                raise
            graph.capture_end()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return first, replay

    return record


@cache
def recording_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream a process records graphs on, per device: cuBLAS keeps a workspace for each stream it meets
    (tens of MiB that stay allocated), and torch hands out new streams from a pool of 32 per device, so a stream
    per recording would leave up to 32 workspaces behind."""
    return torch.cuda.Stream(device)


@dataclass
class _Bucket:
    """The buffers one recorded step reads, for a bucket of rows, and its replay once recorded."""

    tokens: torch.Tensor  # [bucket] each row's last sampled token
    tables: torch.Tensor  # [bucket, blocks] block tables
    lengths: torch.Tensor  # [bucket] tokens stored after the step
    rows: int = 0  # real rows the buffers hold; the rest are sink rows
    replay: Step | None = None


class StepGraphs:
    """The decode forwards of one sampling call, recorded per (row bucket, block-table width); see the module
    docstring. `record`: how a step is recorded (`cuda_graph_recorder` on a GPU)."""

    def __init__(self, model: Any, cache: PagedCache, pad_id: int, record: Recorder) -> None:
        if cache.pool.sink is None:
            raise ValueError("recorded decode steps need a KV pool with a sink block for their padding rows")
        self.model, self.cache, self.pad_id, self.record = model, cache, pad_id, record
        self.sink: int = cache.pool.sink
        self._buckets: dict[tuple[int, int], _Bucket] = {}

    def logits(
        self, tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """[R, V] next-token logits of the rows whose block tables are `tables[rows]` ([R] on the device), after
        feeding each its token `tokens` ([R]), `lengths` ([R]) tokens stored then. A view of the graph's output:
        read it before the next call."""
        count = len(tokens)
        bucket = self._bucket(row_bucket(count), tables.shape[1])
        bucket.tokens[:count].copy_(tokens)
        bucket.lengths[:count].copy_(lengths)
        torch.index_select(tables, 0, rows, out=bucket.tables[:count])
        if bucket.rows > count:
            self._sink_rows(bucket, count)
        bucket.rows = count
        if bucket.replay is None:
            first, bucket.replay = self.record(partial(self._step, bucket))
            return first[:count]
        return bucket.replay()[:count]

    def release(self) -> None:
        """Drop the call's recorded steps when it ends. A replay may hold its step, which holds its bucket and this
        object (the eager stand-ins' do): cycles that would keep the graphs and the pool they read until the
        collector runs."""
        for bucket in self._buckets.values():
            bucket.replay = None
        self._buckets.clear()

    def _bucket(self, size: int, width: int) -> _Bucket:
        bucket = self._buckets.get((size, width))
        if bucket is None:
            device = self.cache.pool.device
            bucket = _Bucket(
                torch.empty(size, dtype=torch.long, device=device),
                torch.empty((size, width), dtype=torch.long, device=device),
                torch.empty(size, dtype=torch.long, device=device),
            )
            self._sink_rows(bucket, 0)
            self._buckets[size, width] = bucket
        return bucket

    def _sink_rows(self, bucket: _Bucket, first: int) -> None:
        """Rows `first` on of the bucket hold one token in the sink block."""
        bucket.tokens[first:] = self.pad_id
        bucket.tables[first:] = self.sink
        bucket.lengths[first:] = 1

    def _step(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's decode forward, from its buffers alone: [bucket, V] logits."""
        pool_blocks, block_tokens = self.cache.pool.capacity, self.cache.pool.shape.block_tokens
        grid = bucket.tables.shape[1] * block_tokens  # only transformers' forward asks for it; the lean one does not
        tokens = bucket.tokens.unsqueeze(-1)
        plan = plan_paged_decode(bucket.tables, bucket.lengths, tokens, block_tokens, pool_blocks, grid)
        self.cache.plan = plan
        logits = causal_lm_logits(
            self.model, plan.input_ids, None, plan.position_ids, self.cache, logits_to_keep=1, padded=False
        )
        return logits[:, -1]
