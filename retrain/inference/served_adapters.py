"""Versioned adapters on an inference server: how a vLLM or SGLang server follows training.

After every optimizer step the adapter is written to a new directory `policy-v{N}`
(retrain.inference.adapters) and loaded under that new name through the server's runtime-LoRA
route; the previous name is then unloaded. Requests name the newest adapter, so a server never
answers with a cached older one, and its prefix cache (keyed by adapter) never mixes versions.
Sampling ahead (training.max_staleness, docs/async.md), the versions from `keep_from` on stay loaded, and
the producer's requests name the version their batch is pinned to (`pinned`) while newer ones load.
A name the server already holds (left by an earlier run on a long-lived server) is unloaded and
loaded again from the new directory: re-using it in place would serve the old weights.
Where `inference.url` names several servers, each version is loaded on every one before any request
names it. The ranks of a data-parallel run share the servers: each serves its own `policy-v{N}-r{rank}`
(retrain.inference.adapters.rank_tag), so no rank unloads a name another still samples with.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrain.errors import ConfigError
from retrain.inference.adapters import AdapterPublisher, adapter_name, initial_update, rank_tag
from retrain.inference.http import HttpClient, HttpError, excerpt
from retrain.model.probe import StaleWeightsError
from retrain.model.resources import EngineResources
from retrain.types import WeightUpdate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraRoutes:
    """A server's runtime-LoRA routes (both take JSON {"lora_name", ...}) and how it must be started to have them."""

    load: str
    unload: str
    server: str  # e.g. "vLLM", for messages
    requirements: str  # what the server needs, e.g. "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"


class ServedAdapters:
    """Pushes each WeightUpdate to a server as a new `policy-v{N}` adapter (see the module docstring)."""

    def __init__(
        self,
        clients: HttpClient | list[HttpClient],
        routes: LoraRoutes,
        resources: EngineResources,
        adapter_root: str,
        fault_skip_weight_sync: bool,
    ) -> None:
        self.clients = clients if isinstance(clients, list) else [clients]  # every server of inference.url
        self.routes = routes
        self.lora_rank = resources.spec.lora_rank
        self.tag = rank_tag()  # ranks sharing the servers serve their own names
        self.publisher = AdapterPublisher(resources.spec, Path(adapter_root) if adapter_root else None, tag=self.tag)
        self.fault_skip_weight_sync = fault_skip_weight_sync
        self.version = 0  # the weights version the served adapter holds
        self.served: str | None = None  # the newest adapter; None = the base model (no adapter yet)
        self.loaded: dict[int, str] = {}  # weights version -> adapter name, on every server, oldest first
        self.keep_from: int | None = None  # the oldest version kept loaded (None: the newest only)
        self.pinned: int | None = None  # the version sampling requests name (None: the newest)
        first = initial_update(resources)
        if first is not None:
            try:
                self._serve(first)
            except BaseException:
                self.publisher.close()
                raise

    def sync(self, update: WeightUpdate) -> None:
        """Serve `update` from now on (StaleWeightsError for a version older than the one served)."""
        if update.version < self.version:
            raise StaleWeightsError(
                f"asked to sync to weights version {update.version}, but {self._where()} already "
                f"serves version {self.version}"
            )
        if self.fault_skip_weight_sync:
            log.warning(
                "inference.fault_skip_weight_sync=true (a test hook): weights version %d is NOT pushed to %s",
                update.version,
                self._where(),
            )
            return
        self._serve(update)

    def sampled_name(self) -> str | None:
        """The adapter a sampling request names: the pinned version's, or the newest."""
        if self.pinned is None:
            return self.served
        name = self.loaded.get(self.pinned)
        if name is None:
            raise StaleWeightsError(
                f"a batch is pinned to weights version {self.pinned}, but {self._where()} holds only versions "
                f"{sorted(self.loaded)}"
            )
        return name

    def close(self) -> None:
        """Unload the adapters (best effort: the server may be gone) and remove the published directories."""
        try:
            for name in self.loaded.values():
                for client in self.clients:
                    try:
                        self._unload(client, name, max_retries=0)
                    except HttpError as error:
                        log.warning("could not unload %s from %s: %s", name, client.base_url, error)
        finally:
            self.served = None
            self.loaded.clear()
            self.publisher.close()

    def _serve(self, update: WeightUpdate) -> None:
        self.publisher.keep = max(self.publisher.keep, len(self.loaded) + 1)  # a server may reload a loaded one
        path = self.publisher.publish(update)
        name = adapter_name(update.version, self.tag)
        for client in self.clients:
            self._load(client, name, path)
        self.loaded[update.version] = name
        self.served, self.version = name, update.version
        for version, older in list(self.loaded.items()):
            if older != name and (self.keep_from is None or version < self.keep_from):
                del self.loaded[version]
                for client in self.clients:
                    try:
                        self._unload(client, older)
                    except HttpError as error:  # harmless: no request names it any more
                        log.warning("could not unload %s from %s: %s", older, client.base_url, error)

    def _where(self) -> str:
        return ", ".join(client.base_url for client in self.clients)

    def _load(self, client: HttpClient, name: str, path: Path) -> None:
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
        try:
            client.post(self.routes.load, body, max_retries=0)
            return
        except HttpError as error:
            if error.status is None:  # no answer: the server is unreachable, not misconfigured
                raise
            if not (error.status == 400 and "already" in error.body):
                raise self._load_error(client, name, path, error) from None
        # the server holds this name from before (a resumed run, an earlier run): never re-use it in place
        log.info("%s at %s already holds %s: unloading it first", self.routes.server, client.base_url, name)
        self._unload(client, name)
        try:
            client.post(self.routes.load, body, max_retries=0)
        except HttpError as error:
            raise error if error.status is None else self._load_error(client, name, path, error) from None

    def _unload(self, client: HttpClient, name: str, max_retries: int | None = None) -> None:
        client.post(self.routes.unload, {"lora_name": name}, max_retries=max_retries)

    def _load_error(self, client: HttpClient, name: str, path: Path, error: HttpError) -> ConfigError:
        routes, url = self.routes, client.base_url
        if error.status in (404, 405) and str(path) not in error.body:
            return ConfigError(
                f"{routes.server} at {url} has no runtime-LoRA route {routes.load} ({error.status}): "
                f"start it with {routes.requirements}"
            )
        return ConfigError(
            f"{routes.server} at {url} could not load {name} from {path}: {error.status} {excerpt(error.body)}. "
            f"It must run with {routes.requirements} and --max-lora-rank >= {self.lora_rank} (model.lora_rank), "
            f"and read {path.parent} (set inference.adapter_root to a directory the server can read)"
        )
