"""PRIME-RL's two rollout transports with retrain as the sender: files in a temp dir (never a partial
rank_R.bin), and ZMQ on loopback against a receiver that does what PRIME-RL's ZMQMicroBatchReceiver does."""

from __future__ import annotations

import threading

import pytest
import zmq

from retrain.backend.prime_rl.messages import decode_rank, encode_rank
from retrain.backend.prime_rl.packing import pack, row_samples
from retrain.backend.prime_rl.transport import FilesystemSender, ZmqSender
from retrain.errors import UserError
from tests.backend.prime_rl_helpers import free_port_pair, train_batch


def test_filesystem_writes_each_rank_under_its_step(tmp_path):
    grid = pack(row_samples(train_batch()), seq_len=8, num_ranks=2)
    FilesystemSender(tmp_path).send(3, [encode_rank(rank) for rank in grid])
    step = tmp_path / "rollouts" / "step_3"
    assert sorted(path.name for path in step.iterdir()) == ["rank_0.bin", "rank_1.bin"]
    assert [decode_rank((step / f"rank_{r}.bin").read_bytes()) for r in range(2)] == grid


def test_filesystem_never_shows_a_partial_rank_file(tmp_path):
    payload = b"\x91" + b"x" * (64 << 20)  # big enough that writing it takes many polls
    seen: list[int] = []
    done = threading.Event()
    target = tmp_path / "rollouts" / "step_1" / "rank_0.bin"

    def watch() -> None:  # what PRIME-RL's receiver does: wait for the .bin to exist, then read it
        while not done.is_set():
            if target.exists():
                seen.append(len(target.read_bytes()))
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    FilesystemSender(tmp_path).send(1, [payload])
    done.set()
    watcher.join()
    assert seen in ([], [len(payload)])
    assert target.read_bytes() == payload and not list(target.parent.glob("*.tmp"))


def test_zmq_delivers_each_rank_its_micro_batches_after_ready():
    port = free_port_pair()
    grid = pack(row_samples(train_batch()), seq_len=8, num_ranks=2)
    sender = ZmqSender("127.0.0.1", port, hwm=10, ranks=2, ready_wait_s=10.0)
    context = zmq.Context()
    receivers = []
    try:
        for rank in range(2):  # PRIME-RL's ZMQMicroBatchReceiver: SUB on its topic, then READY on port + 1
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, 10)
            sub.connect(f"tcp://127.0.0.1:{port}")
            sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|" + str(rank).encode() + b"|")
            ready = context.socket(zmq.PUSH)
            ready.connect(f"tcp://127.0.0.1:{port + 1}")
            ready.send(str(rank).encode())
            receivers.append((sub, ready))
        sender.send(1, [encode_rank(rank) for rank in grid])
        for rank, (sub, _) in enumerate(receivers):
            assert sub.poll(10_000), f"rank {rank} received nothing"
            topic, payload = sub.recv_multipart()
            assert topic == f"data_rank|{rank}|".encode()
            assert decode_rank(payload) == grid[rank]
    finally:
        for sub, ready in receivers:
            sub.close(linger=0)
            ready.close(linger=0)
        context.term()
        sender.close()


def test_zmq_names_the_ready_endpoint_when_no_trainer_comes():
    port = free_port_pair()
    sender = ZmqSender("127.0.0.1", port, hwm=10, ranks=1, ready_wait_s=0.2)
    try:
        ready = f"tcp://127.0.0.1:{port + 1}"
        with pytest.raises(UserError, match=f"0 of 1 PRIME-RL trainer ranks announced READY on {ready}"):
            sender.send(1, [b"\x90"])
    finally:
        sender.close()
