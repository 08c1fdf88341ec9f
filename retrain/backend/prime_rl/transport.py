"""How a step's micro-batches reach the PRIME-RL trainer: PRIME-RL's two rollout transports.

Both follow src/prime_rl/transports/rollouts/{filesystem,zmq}.py of PRIME-RL v0.8.1.dev67 (commit
559b44772e471d1538537b8805cc77f3824a5e64), with retrain in the orchestrator's (sender's) seat:

- filesystem: rank R's bytes go to `<output_dir>/rollouts/step_N/rank_R.bin`, written as
  `rank_R.bin.tmp` and renamed, so the trainer (which waits for the .bin to exist) never reads a
  partial file.
- zmq: a PUB socket bound at tcp://zmq_host:zmq_port (SNDHWM = zmq_hwm) sends each rank the
  multipart message [b"data_rank|R|", bytes]; the trainer ranks SUBscribe to their topic and announce
  themselves by PUSHing their rank (ASCII) to a PULL socket bound at zmq_port + 1. PUB drops what no
  subscriber receives, so nothing is sent before every rank said READY. retrain's socket is an XPUB
  (the same wire as PUB) so it also sees each rank's subscription arrive: READY travels on another
  connection and can overtake it, and a message sent in that gap would be lost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Protocol

from retrain.errors import ConfigError, UserError

TOPIC_PREFIX = b"data_rank|"


def topic(rank: int) -> bytes:
    """The ZMQ topic data rank `rank` subscribes to."""
    return TOPIC_PREFIX + str(rank).encode() + b"|"


class RolloutSender(Protocol):
    def send(self, step: int, payloads: list[bytes]) -> None:
        """Deliver step `step`: payloads[R] is data rank R's encoded list[MicroBatch]."""

    def close(self) -> None: ...


def rollout_step_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "rollouts" / f"step_{step}"


class FilesystemSender:
    """PRIME-RL's filesystem rollout transport (see the module docstring)."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir

    def send(self, step: int, payloads: list[bytes]) -> None:
        directory = rollout_step_dir(self.output_dir, step)
        directory.mkdir(parents=True, exist_ok=True)
        for rank, payload in enumerate(payloads):
            partial = directory / f"rank_{rank}.bin.tmp"
            with open(partial, "wb") as file:
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())  # a trainer on another node reads it over a shared filesystem
            os.replace(partial, directory / f"rank_{rank}.bin")

    def close(self) -> None:
        pass


class ZmqSender:
    """PRIME-RL's ZMQ rollout transport (see the module docstring); binds at construction, so the
    trainer ranks can connect while the first step samples."""

    def __init__(self, host: str, port: int, hwm: int, ranks: int, ready_wait_s: float) -> None:
        import zmq

        self.ranks = ranks
        self.ready_wait_s = ready_wait_s
        self.endpoint = f"tcp://{host}:{port}"
        self.ready_endpoint = f"tcp://{host}:{port + 1}"
        self.context = zmq.Context()
        self.data: Any = self.context.socket(zmq.XPUB)
        self.ready: Any = self.context.socket(zmq.PULL)
        try:
            self.data.setsockopt(zmq.SNDHWM, hwm)
            self.data.bind(self.endpoint)
            self.ready.setsockopt(zmq.RCVHWM, hwm)
            self.ready.bind(self.ready_endpoint)
        except zmq.ZMQError as error:
            self.close()
            raise ConfigError(
                f"backend.zmq_host={host!r}, backend.zmq_port={port}: cannot bind {self.endpoint} and "
                f"{self.ready_endpoint} ({error}); both ports must be free on this host"
            ) from error
        self._announced: set[int] = set()
        self._subscribed: set[bytes] = set()

    def send(self, step: int, payloads: list[bytes]) -> None:
        self._wait_for_ranks()
        for rank, payload in enumerate(payloads):
            self.data.send_multipart([topic(rank), payload], copy=False)

    def _wait_for_ranks(self) -> None:
        import zmq

        deadline = time.monotonic() + self.ready_wait_s
        poller = zmq.Poller()
        poller.register(self.ready, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        while len(self._announced) < self.ranks or not self._subscribed.issuperset(map(topic, range(self.ranks))):
            remaining_ms = int(1000 * (deadline - time.monotonic()))
            events = dict(poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if not events:
                raise UserError(
                    f"backend=prime_rl: {len(self._announced)} of {self.ranks} PRIME-RL trainer ranks announced "
                    f"READY on {self.ready_endpoint} ({len(self._subscribed)} subscribed on {self.endpoint}) within "
                    f"backend.sync_wait_s={self.ready_wait_s:g} s; start the "
                    f"trainer with rollout_transport.type=zmq, host and port matching {self.endpoint}, and "
                    "backend.num_train_workers equal to its data-parallel size"
                )
            if self.data in events:
                event = self.data.recv()  # b"\x01" + topic: a subscriber joined
                if event[:1] == b"\x01":
                    self._subscribed.add(event[1:])
            if self.ready in events:
                try:
                    self._announced.add(int(self.ready.recv().decode()))
                except ValueError:
                    continue  # PRIME-RL's sender ignores what is not a rank, too

    def close(self) -> None:
        self.data.close(linger=0)
        self.ready.close(linger=0)
        self.context.term()
