"""Many HTTP requests, one engine batch: requests that arrive together are sampled in one engine call.

The loopback endpoint (retrain.inference.endpoint) answers each request on its own thread; they all hand their
TokenRequest to one batcher, whose worker thread owns the engine. When the engine is free, the worker waits a
short gathering window (`GATHER_S`) after the first request, then takes every queued request that shares its
temperature and top_p and samples them together (`engine.generate_requests`; the pytorch engine decodes them as
one continuous batch, and answers each request as soon as its row finishes). Requests that arrive while a batch
decodes wait for the next one: with episodes whose turns fall out of step, each batch still holds whatever is
waiting, so the engine decodes as many rows as are in flight.

Why batches at a boundary rather than admitting rows into the running decode: both keep reproducibility (a
request's tokens are drawn with the uniforms of its own seed, row 0 and position, whatever shares its batch), and
this one leaves the engine's decode loop as it is; admitting mid-decode saves the wait of a request that arrives
while a batch decodes, and is the next step (docs/agents.md).

An engine without `generate_requests` (vLLM, the server engines) is called once per request, in arrival order.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from retrain.inference.base import InferenceEngine
from retrain.inference.requests import TokenCompletion, TokenRequest, completions_of

log = logging.getLogger(__name__)

GATHER_S = 0.005  # after the first request reaches an idle engine, wait this long for the others sent with it


class RequestBatcher:
    """Samples the requests given to `complete` (from any thread) in batches on `engine`; see the module docstring."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.largest_batch = 0  # the most requests sampled in one engine call so far
        self._queue: list[tuple[TokenRequest, Future[TokenCompletion]]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="retrain-request-batcher", daemon=True)
        self._worker.start()

    def complete(self, request: TokenRequest) -> TokenCompletion:
        """The engine's completion of `request`, sampled in the next batch (blocks until it is)."""
        done: Future[TokenCompletion] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the endpoint is closed")
            self._queue.append((request, done))
            self._ready.notify()
        return done.result()

    def close(self) -> None:
        """Stop the worker after the batch in flight; requests still queued fail."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._worker.join()
        for _, done in self._queue:
            done.set_exception(RuntimeError("the endpoint closed before this request was sampled"))
        self._queue.clear()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return
            time.sleep(GATHER_S)
            with self._ready:
                batch = self._take()
            self._sample(batch)

    def _take(self) -> list[tuple[TokenRequest, Future[TokenCompletion]]]:
        """Every queued request that samples like the first (temperature, top_p), in arrival order."""
        first = self._queue[0][0].sampling
        kind = (first.temperature, first.top_p)
        batch: list[tuple[TokenRequest, Future[TokenCompletion]]] = []
        rest: list[tuple[TokenRequest, Future[TokenCompletion]]] = []
        for item in self._queue:
            (batch if (item[0].sampling.temperature, item[0].sampling.top_p) == kind else rest).append(item)
        self._queue = rest
        return batch

    def _sample(self, batch: list[tuple[TokenRequest, Future[TokenCompletion]]]) -> None:
        requests = [request for request, _ in batch]
        self.largest_batch = max(self.largest_batch, len(requests))

        def answer(index: int, completion: TokenCompletion) -> None:
            batch[index][1].set_result(completion)

        try:
            generate_requests = getattr(self.engine, "generate_requests", None)
            if generate_requests is not None:
                generate_requests(requests, answer)  # each request is answered as it finishes
            else:
                for index, r in enumerate(requests):
                    answer(index, completions_of(self.engine.generate([r.prompt_ids], 1, r.sampling, r.seed))[0])
        except Exception as error:  # every request still waiting answers with it; the worker serves the next batch
            for _, done in batch:
                if not done.done():
                    done.set_exception(error)
