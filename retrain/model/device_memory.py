"""How much memory the devices of `backend.devices` have, read without loading a model.

A GPU: CUDA's total memory of that device (torch.cuda.get_device_properties). The CPU (`cpu`, or `gpu:N` on a
machine without CUDA, where the backend falls back to the CPU): what the machine can still give this process,
the kernel's MemAvailable, or the cgroup's memory limit less its usage when a container sets a smaller one.
"""

from __future__ import annotations

from pathlib import Path

from retrain.housekeeping.digits import whole_number

MEMINFO = Path("/proc/meminfo")
CGROUP_FILES = (  # (limit, usage): cgroup v2, then v1
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
)


def device_memories(devices: str) -> tuple[list[int | None], bool]:
    """(memory of each device the run uses, whether they are GPUs): two GPUs in split mode, else one; the CPU's
    memory when CUDA is absent (as retrain.backend.devices falls back); None where it cannot be read."""
    specs = [spec.strip() for spec in devices.split(",") if spec.strip()] or ["cpu"]
    gpus = [spec for spec in specs if spec.startswith("gpu:")]
    if gpus and len(gpus) == len(specs) and cuda_available():
        import torch

        indices = [int(spec.partition(":")[2]) for spec in specs]
        memories: list[int | None] = [
            int(torch.cuda.get_device_properties(index).total_memory) if index < torch.cuda.device_count() else None
            for index in indices
        ]
        return (memories if len(set(specs)) == 2 else memories[-1:]), True
    return [cpu_memory()], False


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except (ImportError, RuntimeError):
        return False


def cpu_memory() -> int | None:
    """Bytes this process may still fill: MemAvailable, or less when a cgroup limit leaves less."""
    available = _meminfo_available()
    for limit_file, usage_file in CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 writes a huge number for "no limit"
            left = max(0, limit - usage)
            available = left if available is None else min(available, left)
            break
    return available


def _meminfo_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return whole_number(text)  # "max": no limit
