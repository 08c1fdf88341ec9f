"""What each rank of `torchrun --nproc-per-node=2 tests/distributed/ranks.py OUT` computes with retrain's
collectives on a real gloo group; rank r writes OUT/rank<r>.json for tests/distributed/test_collectives.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch

from retrain.distributed.gradients import all_reduce_gradients, weights_checksum
from retrain.distributed.rows import gather_rows
from retrain.distributed.world import all_sum, check_agreed, collectives_on, join_world, leave_world, thread_group
from retrain.errors import ConfigError


def refusal(name: str, value: object) -> str | None:
    """check_agreed's message when the ranks' values differ (None: they agreed)."""
    try:
        check_agreed(name, value)
    except ConfigError as error:
        return str(error)
    return None


def crossed_collectives(rank: int, rows: torch.Tensor) -> dict[str, object]:
    """A second thread's gather (the producer's, on its own group) and the main thread's all-reduce, issued in
    opposite orders on the two ranks: rank 0 gathers first, rank 1 all-reduces first. On one group they would
    pair up wrongly; on two, each gets its own answer."""
    group = thread_group()
    issued = threading.Event()
    gathered: list[object] = []

    def gather() -> None:
        if rank == 1:
            issued.wait()
            time.sleep(0.3)  # the main thread's all-reduce is under way
        with collectives_on(group):
            issued.set()
            gathered.append(gather_rows(rows, pad_value=-1).tolist())

    thread = threading.Thread(target=gather)
    thread.start()
    if rank == 0:
        issued.wait()
        time.sleep(0.3)  # the thread's gather is under way
    issued.set()
    summed = all_sum(torch.tensor([rank + 1.0])).tolist()
    thread.join()
    return {"gathered": gathered[0], "summed": summed}


def main(out: Path) -> None:
    world = join_world("cpu")
    rank = world.rank
    # rank r holds r + 1 rows of width 2 + r: the gathered batch is 3 rows, padded to width 3
    rows = torch.arange(10 * rank, 10 * rank + (rank + 1) * (2 + rank)).view(rank + 1, 2 + rank)
    a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.full((2, 2), float(rank + 1))
    b.grad = torch.ones(3) if rank == 0 else None  # a rank that trained no row has no gradient
    all_reduce_gradients([a, b])
    result = {
        "share": world.share(5),
        "right": gather_rows(rows, pad_value=-1).tolist(),
        "left": gather_rows(rows, pad_value=-1, left=True).tolist(),
        "grads": [a.grad.tolist(), b.grad.tolist()],
        "same": refusal("seed", 7),
        "different": refusal("config", {"training.lr": 0.1 * (rank + 1)}),
        "diverged": refusal("adapter checksum after step 9", weights_checksum({"w": torch.full((2,), float(rank))})),
        "crossed": crossed_collectives(rank, rows),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    leave_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
