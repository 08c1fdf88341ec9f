"""How a launch meets its ranks, read without torch: the world size a launch plans and the rendezvous variables
torchrun or submitit set (what `retrain explain` and `retrain doctor` show)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from retrain.errors import ConfigError

# env:// rendezvous (torch.distributed): what each rank must find in its environment
RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def planned_world_size(launcher: Mapping[str, Any]) -> int:
    """Ranks a launch runs on: a submitit launcher's (slurm, local) `tasks_per_node × nodes`, else torchrun's
    WORLD_SIZE (in the environment of a command run under it), else 1."""
    if "tasks_per_node" in launcher:
        return int(launcher.get("tasks_per_node") or 1) * int(launcher.get("nodes") or 1)
    return env_int("WORLD_SIZE", 1)


def env_int(name: str, default: int) -> int:
    """The integer rendezvous variable `name` (RANK, WORLD_SIZE, LOCAL_RANK), `default` when unset: a ConfigError
    naming the variable when it is not an integer (torchrun and submitit set them; a hand-set one may be wrong)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"{name}={value!r} in the environment is not an integer: a data-parallel run reads RANK, WORLD_SIZE and "
            "LOCAL_RANK as torchrun or submitit set them (unset them for one process)"
        ) from None


def planned_local_ranks(launcher: Mapping[str, Any]) -> int:
    """Ranks a launch runs on each machine, which share its host memory: a submitit launcher's `tasks_per_node`, else
    torchrun's LOCAL_WORLD_SIZE (at most WORLD_SIZE, and only when WORLD_SIZE > 1: vLLM-CPU leaves a LOCAL_WORLD_SIZE
    in a process of one), else WORLD_SIZE (every rank on this machine), else 1."""
    if "tasks_per_node" in launcher:
        return int(launcher.get("tasks_per_node") or 1)
    ranks = int(os.environ.get("WORLD_SIZE") or 1)
    if ranks <= 1:
        return 1
    return min(ranks, int(os.environ.get("LOCAL_WORLD_SIZE") or ranks))


def check_one_device_per_rank(devices: str, ranks: int) -> None:
    """ConfigError naming `backend.devices` when split mode (two devices: sampling beside training, in one process)
    meets a run of several ranks, which gives each rank one device. The run refuses it before anything loads
    (retrain.run.check_data_parallel; rank_devices too), `retrain explain` when it plans the launch."""
    if ranks > 1 and "," in devices:
        raise ConfigError(
            f"backend.devices={devices!r}: split mode runs on one process; a run on {ranks} ranks gives "
            "each rank one device (backend.devices=gpu:0 or cpu)"
        )


def rendezvous_report(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The rendezvous variables as set here, and what keeps the ranks from meeting (None: nothing, or one process)."""
    variables = {name: environ.get(name) for name in RENDEZVOUS_VARIABLES}
    return {"variables": variables, "problem": rendezvous_problem(variables)}


def rendezvous_problem(variables: Mapping[str, str | None]) -> str | None:
    """Why ranks with these variables cannot meet; None when they can, or when none is set (one process)."""
    if variables.get("WORLD_SIZE") is None and variables.get("RANK") is None:
        return None
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not variables.get(name)]
    if missing:
        return f"{', '.join(missing)} not set (start the ranks with torchrun, or hydra/launcher=slurm)"
    try:
        rank, size, port = (
            int(str(variables["RANK"])),
            int(str(variables["WORLD_SIZE"])),
            int(str(variables["MASTER_PORT"])),
        )
    except ValueError:
        return "RANK, WORLD_SIZE and MASTER_PORT must be integers"
    if not 0 <= rank < size:
        return f"RANK={rank} is not below WORLD_SIZE={size}"
    if not 0 < port < 65536:
        return f"MASTER_PORT={port} is not a port"
    return None
