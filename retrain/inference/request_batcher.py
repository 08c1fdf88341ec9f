"""Many HTTP requests, one engine batch: requests in flight together are sampled in one engine call.

The loopback endpoint (retrain.inference.endpoint) answers each request on its own thread; they all hand their
TokenRequest to one batcher. For an engine in this process (pytorch, vllm), the batcher's worker thread owns the
engine: when it is idle, the worker waits a short gathering window (`GATHER_S`) after the first request, then takes
every queued request that shares its temperature and top_p and samples them together (`engine.generate_requests`),
answering each request as soon as its row finishes. Before every decode step the engine asks for the requests that
arrived since and admits those that fit (same temperature and top_p; pytorch: max_tokens and prompt within the
call's limits; vLLM: within its max_model_len) into the running batch: an agent's next turn joins the decode its
episode's siblings are still in, instead of waiting for it to end. A request that does not fit waits for the next call.

An engine that samples on servers (`generate_request`: vllm_server, sglang, openai) is called on each request's own
thread, all at once, and the servers batch what reaches them together; with several servers (`inference.url` a
list) the requests go to them in turn. A plugin engine with neither method is called once per request, in arrival
order.

Reproducibility: a request draws its tokens with its own seed (what `generate([prompt], 1, ...)` draws for it
alone), whatever shares its batch and whenever it joined; only the log-probs' last bits may differ (other batch
shapes), so `data.max_concurrent` 1 and 16 give the same rollouts.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from retrain.inference.base import InferenceEngine
from retrain.inference.completions import Completion
from retrain.inference.requests import TokenRequest, completions_of

GATHER_S = 0.005  # after the first request reaches an idle engine, wait this long for the others sent with it


class RequestBatcher:
    """Samples the requests given to `complete` (from any thread) in batches on `engine`; see the module docstring."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.most_in_flight = 0  # the most requests waiting or decoding at once so far
        self._in_flight = 0
        self._queue: list[tuple[TokenRequest, Future[Completion]]] = []
        self._ready = threading.Condition()
        self._closed = False
        self._arrivals = 0  # requests taken so far (a server engine's requests go to its servers in turn)
        self._on_servers: Callable[[TokenRequest, int], Completion] | None = getattr(engine, "generate_request", None)
        self._worker = threading.Thread(target=self._run, name="retrain-request-batcher", daemon=True)
        if self._on_servers is None:
            self._worker.start()

    def complete(self, request: TokenRequest) -> Completion:
        """The engine's completion of `request`, sampled in the next batch (blocks until it is)."""
        done: Future[Completion] = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the endpoint is closed")
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
            arrival = self._arrivals
            self._arrivals += 1
            if self._on_servers is None:
                self._queue.append((request, done))
                self._ready.notify()
        try:
            if self._on_servers is not None:
                return self._on_servers(request, arrival)
            return done.result()
        finally:
            with self._ready:
                self._in_flight -= 1

    def close(self) -> None:
        """Stop the worker after the batch in flight; requests still queued fail."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        if self._worker.is_alive():
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
                batch = self._take(functools.partial(_samples_like, self._queue[0][0]))
            self._sample(batch)

    def _take(self, fits: Callable[[TokenRequest], bool]) -> list[tuple[TokenRequest, Future[Completion]]]:
        """The queued requests `fits` accepts, in arrival order, out of the queue (the caller holds the lock)."""
        taken: list[tuple[TokenRequest, Future[Completion]]] = []
        rest: list[tuple[TokenRequest, Future[Completion]]] = []
        for item in self._queue:
            (taken if fits(item[0]) else rest).append(item)
        self._queue = rest
        return taken

    def _sample(self, batch: list[tuple[TokenRequest, Future[Completion]]]) -> None:
        """Sample `batch` in one engine call; requests that arrive meanwhile and fit join it (numbered after it)."""

        def answer(index: int, completion: Completion) -> None:
            batch[index][1].set_result(completion)

        def more(fits: Callable[[TokenRequest], bool]) -> list[TokenRequest]:
            with self._ready:
                joined = [] if self._closed else self._take(fits)
            batch.extend(joined)
            return [request for request, _ in joined]

        try:
            generate_requests = getattr(self.engine, "generate_requests", None)
            if generate_requests is not None:
                generate_requests([request for request, _ in batch], answer, more)  # answered as each finishes
            else:  # a plugin engine: one request at a time
                for index, (r, _) in enumerate(batch):
                    answer(index, completions_of(self.engine.generate([r.prompt_ids], 1, r.sampling, r.seed))[0])
        except Exception as error:  # every request still waiting answers with it; the worker serves the next batch
            for _, done in batch:
                if not done.done():
                    done.set_exception(error)


def _samples_like(first: TokenRequest, request: TokenRequest) -> bool:
    """Whether `request` samples from the same distribution as `first` (temperature and top_p)."""
    return (request.sampling.temperature, request.sampling.top_p) == (first.sampling.temperature, first.sampling.top_p)
