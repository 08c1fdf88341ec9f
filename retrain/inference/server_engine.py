"""What every engine that samples on servers sets up the same way: a client per server, the route it samples
on, the tokenizer facts its reply checks need (stop ids, vocabulary size), and how a step's groups spread
over several servers.

`inference.url` may name several servers (retrain.inference.config.server_urls): group k of a step's batch
(its global index, whatever rank samples it) goes to server k mod S, so which server samples a group depends
neither on the number of ranks nor on which rank holds it. Every server must serve the same base model;
each step's adapter is loaded on all of them (retrain.inference.served_adapters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from retrain.inference.completions import Completion, stop_token_ids
from retrain.inference.config import HttpEngineConfig, server_urls
from retrain.inference.http import MIB, HttpClient, api_key_from_env
from retrain.inference.replies import ServerRoute, vocab_size
from retrain.inference.requests import TokenRequest, completions_of
from retrain.inference.served_adapters import ServedAdapters
from retrain.model.resources import EngineResources
from retrain.types import Rollouts
from retrain.waiting import wait_responsively

_placed_on: ContextVar[int | None] = ContextVar("retrain_server_placement", default=None)  # generate_request's


@dataclass(frozen=True)
class Server:
    """One server of `inference.url`: its client and the route the engine samples on there."""

    client: HttpClient
    url: str
    route: ServerRoute


class ServerEngine:
    """The shared part of vllm_server, sglang and openai: built from `inference.*` (`HttpEngineConfig`).

    `client`, `url` and `route` are the first server's (start-up questions whose answer all servers share:
    the model's name); `servers` lists them all. The servers sample on devices of their own (`own_device`), so the
    trainer may sample ahead with them (training.max_staleness, docs/async.md)."""

    own_device = True
    generate: Callable[..., Rollouts]  # each engine's own (InferenceEngine.generate)
    adapters: ServedAdapters | None  # the versioned adapters the servers load (None: the base model only)

    def __init__(
        self, config: HttpEngineConfig, tokenizer: Any, resources: EngineResources, engine: str, route: str
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, getattr(resources.model, "generation_config", None))
        self.vocab_size = vocab_size(tokenizer, resources.model)
        api_key = api_key_from_env(config.api_key_env)
        self.servers: list[Server] = []
        try:
            for url in server_urls(config.url):
                client = HttpClient(
                    url,
                    timeout_s=config.timeout_s,
                    max_retries=config.max_retries,
                    max_concurrency=config.max_concurrency,
                    api_key=api_key,
                    max_reply_bytes=int(config.max_reply_mb * MIB),
                )
                self.servers.append(Server(client, client.base_url, ServerRoute(engine, client.base_url + route)))
        except BaseException:
            self.close_clients()
            raise
        self.client, self.url, self.route = self.servers[0].client, self.servers[0].url, self.servers[0].route
        self.clients = [server.client for server in self.servers]
        self._probes = -1  # freshness probes asked so far, less one (next_probed)

    def server_of(self, group: int) -> Server:
        """The server that samples group `group` (its index in the step's whole batch), or the one the calling
        thread's request was placed on (`generate_request`)."""
        placed = _placed_on.get()
        return self.servers[(group if placed is None else placed) % len(self.servers)]

    @property
    def serves_versions(self) -> bool:
        """Whether several weights versions can be served at once (an engine that loads adapters): sampling ahead,
        a batch then names the version it is pinned to while newer ones load (docs/async.md)."""
        return isinstance(self.adapters, ServedAdapters)

    def keep_versions_from(self, version: int) -> None:
        """Keep the weights versions from `version` on loaded when the next ones load (batches still use them)."""
        assert self.adapters is not None
        self.adapters.keep_from = version

    @contextmanager
    def sampling_version(self, version: int) -> Iterator[None]:
        """Sampling requests name weights version `version` meanwhile (the producer's batch pinned to it); the
        freshness probe keeps naming the newest."""
        assert self.adapters is not None
        self.adapters.pinned = version
        try:
            yield
        finally:
            self.adapters.pinned = None

    def generate_request(self, request: TokenRequest, arrival: int) -> Completion:
        """One endpoint request, on server `arrival` mod S: the request batcher calls this on every request's own
        thread at once (the HTTP clients are thread-safe) and the servers batch what reaches them together. Seeded
        as `generate([prompt], 1, ...)` seeds it, so the server it lands on does not change what it samples."""
        token = _placed_on.set(arrival)
        try:
            generate: Any = self.generate  # each engine's own
            return completions_of(generate([request.prompt_ids], 1, request.sampling, request.seed))[0]
        finally:
            _placed_on.reset(token)

    def post_groups(
        self, path: str, groups: Sequence[list[dict[str, Any]]], first_group: int
    ) -> list[tuple[ServerRoute, list[Any]]]:
        """POST each group's bodies to its server (`server_of(first_group + i)`), every server at once; each
        group's answers, in order, with the route they came from. The first failure interrupts the others."""
        placed = [self.server_of(first_group + i) for i in range(len(groups))]
        bodies: dict[int, list[dict[str, Any]]] = {}
        for server, group in zip(placed, groups):
            bodies.setdefault(id(server), []).extend(group)
        used = [server for server in self.servers if id(server) in bodies]
        if len(used) == 1:
            answers = {id(used[0]): used[0].client.post_all(path, bodies[id(used[0])])}
        else:
            with ThreadPoolExecutor(len(used), thread_name_prefix="retrain-servers") as pool:
                futures = {id(s): pool.submit(s.client.post_all, path, bodies[id(s)]) for s in used}
                done, _ = wait_responsively(futures.values(), FIRST_EXCEPTION)
                if any(future.exception() is not None for future in done):
                    for server in used:
                        server.client.interrupt()
                    first = next(f for f in done if f.exception() is not None)
                    raise first.exception()  # type: ignore[misc]
                answers = {key: future.result() for key, future in futures.items()}
        taken: dict[int, int] = dict.fromkeys(answers, 0)
        result = []
        for server, group in zip(placed, groups):
            start = taken[id(server)]
            taken[id(server)] = start + len(group)
            result.append((server.route, answers[id(server)][start : start + len(group)]))
        return result

    def next_probed(self) -> Server:
        """The server the next freshness probe asks: each in turn, one per step, so a server left on old weights
        fails the proof within S steps (the proof compares one answer with the trainer's)."""
        self._probes += 1
        return self.servers[self._probes % len(self.servers)]

    def interrupt(self) -> None:
        """Cancel a `generate` in flight (a stop request): it raises SamplingInterrupted."""
        for server in self.servers:
            server.client.interrupt()

    def close_clients(self) -> None:
        for server in self.servers:
            server.client.close()

    @contextmanager
    def closed_on_failure(self) -> Iterator[None]:
        """Close the clients when the rest of the engine's start-up fails (the server answered, the run will not)."""
        try:
            yield
        except BaseException:
            self.close_clients()
            raise
