"""How long a run or a campaign will take, and how many GPU hours it costs, before it starts.

The reference is the typical step times the original retrain documented (docs/capacity-planning.md): Qwen3-4B,
4 prompts × 8 completions of up to 10,240 tokens per step, on one GPU. A config's step time is that
reference scaled linearly by completions per step, by `training.max_tokens` and by the model's
parameter count; a pilot run (`retrain explain --pilot RUN_DIR`) replaces the reference with its own
median step time, scaled the same way from the pilot's config to the planned one. No model is loaded:
the parameter count comes from the model's config.json when a copy is on this machine, else from its
name (`...-4B-...`).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from retrain.model.config_files import local_model_config, params_from_config

# the original retrain's documented "Typical training times": seconds per step of the reference workload
REFERENCE_STEP_S: dict[str, float] = {"h100": 15.0, "a100": 25.0, "rtx4090": 45.0}
REFERENCE_GPU = "h100"
REFERENCE_COMPLETIONS = 4 * 8  # batch_size × group_size
REFERENCE_MAX_TOKENS = 10240
REFERENCE_PARAMS = 4.0e9  # Qwen3-4B
REMOTE_OVERHEAD_S = 2.0  # the original retrain's documentation: a remote service adds ~1-3 s of round-trips per step
# the CPU row: the quickstart's step (8 × 8 completions of up to 8 tokens, the bundled 0.9M-parameter Qwen3),
# ~0.07 s on a quiet 2-core machine (docs/benchmarks.md, "The offline demo"), rounded up for a busier one;
# a smaller step costs as much (fixed per-step overheads dominate)
CPU_REFERENCE_STEP_S = 0.1
CPU_REFERENCE_COMPLETIONS = 8 * 8
CPU_REFERENCE_MAX_TOKENS = 8
CPU_REFERENCE_PARAMS = 898_944.0
# what a run costs besides its steps: interpreter, torch and Hydra imports and the checks before the model
# loads (6-10 s measured on 2 cores), then the weights read from local disk at ~1 GB/s (bf16: 2 bytes each)
STARTUP_S = 10.0
LOAD_BYTES_PER_S = 1.0e9
BYTES_PER_PARAM = 2.0
# substrings of torch.cuda.get_device_name -> the reference row that GPU is timed like
GPU_KINDS: tuple[tuple[str, str], ...] = (("H100", "h100"), ("H200", "h100"), ("A100", "a100"), ("4090", "rtx4090"))
_SIZE_IN_NAME = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([BM])(?![a-zA-Z])", re.IGNORECASE)


@dataclass(frozen=True)
class Workload:
    """What one training step costs, in the terms the estimate scales by."""

    completions: int  # batch_size × group_size
    max_tokens: int
    params: float | None  # the model's parameter count; None when unknown
    params_source: str  # "config.json", "name", or "unknown"
    gpus: int  # local GPUs one run holds (0: CPU, or a remote/external backend)
    remote: bool  # the backend trains elsewhere (no `backend.devices`): its GPUs are not this machine's

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Workload:
        """The workload of a composed config (a plain dict: `OmegaConf.to_container(cfg, resolve=True)`)."""
        training, backend, model = config["training"], config["backend"], config["model"]
        params, source = model_params(str(model["name_or_path"]), model.get("revision"))
        devices = backend.get("devices")
        return cls(
            completions=int(training["batch_size"]) * int(training["group_size"]),
            max_tokens=int(training["max_tokens"]),
            params=params,
            params_source=source,
            gpus=0 if devices is None else gpu_count(str(devices)),
            remote=devices is None,
        )

    def relative_size(self) -> float:
        """This step's cost over the reference step's (an unknown model counts as the reference's size)."""
        params = self.params if self.params is not None else REFERENCE_PARAMS
        return (
            (self.completions / REFERENCE_COMPLETIONS)
            * (self.max_tokens / REFERENCE_MAX_TOKENS)
            * (params / REFERENCE_PARAMS)
        )


@dataclass(frozen=True)
class Pilot:
    """A finished (or running) pilot run's timing."""

    run_dir: str
    median_step_time_s: float
    steps: int
    workload: Workload | None  # None when its config could not be read: its step time is used unscaled


@dataclass(frozen=True)
class StepTime:
    seconds: float | None  # None: no reference fits (a CPU run without a pilot)
    source: str  # "reference:h100", "pilot:<run dir>", or "none"
    notes: tuple[str, ...]


def gpu_count(devices: str) -> int:
    """Distinct GPUs in a `backend.devices` value ("cpu" -> 0, "gpu:0,gpu:1" -> 2)."""
    return len({spec.strip() for spec in devices.split(",") if spec.strip().startswith("gpu:")})


def gpu_kind(device_name: str) -> str | None:
    """The reference row a GPU is timed like, from its CUDA name; None for a GPU the table lacks."""
    return next((kind for marker, kind in GPU_KINDS if marker in device_name.upper()), None)


def model_params(name_or_path: str, revision: str | None = None) -> tuple[float | None, str]:
    """(parameter count, where it came from) without loading the model: its config.json when a copy is
    on this machine (a local dir, a bundled asset, the Hugging Face cache), else the size in its name."""
    config = local_model_config(name_or_path, revision)
    if config is not None:
        params = params_from_config(config)
        if params is not None:
            return params, "config.json"
    match = _SIZE_IN_NAME.search(name_or_path.rstrip("/").rsplit("/", 1)[-1])
    if match is not None:
        return float(match.group(1)) * (1e9 if match.group(2).upper() == "B" else 1e6), "name"
    return None, "unknown"


def read_pilot(run_dir: Path) -> Pilot:
    """The median `step_time_s` of a run dir's metrics.jsonl, and the workload its config describes."""
    from retrain.errors import ConfigError
    from retrain.housekeeping.rundir import RunDir

    files = RunDir(run_dir)
    if not files.metrics.is_file():
        what = "a sweep dir: give one of its run dirs" if (run_dir / "manifest.json").is_file() else "not a run dir"
        raise ConfigError(f"--pilot {run_dir}: {what} (no {files.metrics.name} there)")
    times = [float(r["step_time_s"]) for r in files.metrics_records() if isinstance(r.get("step_time_s"), (int, float))]
    if not times:
        raise ConfigError(f"--pilot {run_dir}: no step with step_time_s in {files.metrics} (run a few steps first)")
    config = files.read_hydra_config()
    try:
        workload: Workload | None = Workload.of(config)
    except (KeyError, TypeError, ValueError):
        workload = None
    return Pilot(str(run_dir), statistics.median(times), len(times), workload)


def step_time(workload: Workload, gpu: str = REFERENCE_GPU, pilot: Pilot | None = None) -> StepTime:
    """Seconds per step of `workload`: the pilot's median scaled to it, else the reference row `gpu` scaled."""
    notes = []
    if workload.params is None:
        notes.append("model size unknown (no local config.json, no size in its name): counted as 4B")
    if pilot is not None:
        if pilot.workload is None:
            notes.append("the pilot's config is unreadable: its median step time is used unscaled")
            return StepTime(pilot.median_step_time_s, f"pilot:{pilot.run_dir}", tuple(notes))
        ratio = workload.relative_size() / pilot.workload.relative_size()
        if abs(ratio - 1.0) > 1e-9:
            notes.append(f"the pilot's step time scaled ×{ratio:.3g} from its batch, tokens and model to this config's")
        return StepTime(pilot.median_step_time_s * ratio, f"pilot:{pilot.run_dir}", tuple(notes))
    if workload.gpus == 0 and not workload.remote:
        notes.append(
            f"CPU: the quickstart's {CPU_REFERENCE_STEP_S} s/step on 2 cores scaled to this config (rough for a "
            "larger model: give --pilot RUN_DIR of a short run of this config)"
        )
        return StepTime(CPU_REFERENCE_STEP_S * max(1.0, cpu_relative_size(workload)), "reference:cpu", tuple(notes))
    seconds = REFERENCE_STEP_S[gpu] * workload.relative_size()
    if workload.remote:
        seconds += REMOTE_OVERHEAD_S
        notes.append(
            f"remote or external backend: its GPUs (not this machine's, so no GPU hours here) timed like one {gpu}, "
            f"plus {REMOTE_OVERHEAD_S:.0f} s/step"
        )
    return StepTime(seconds, f"reference:{gpu}", tuple(notes))


def cpu_relative_size(workload: Workload) -> float:
    """This step's cost over the CPU reference step's (the quickstart's)."""
    params = workload.params if workload.params is not None else REFERENCE_PARAMS
    return (
        (workload.completions / CPU_REFERENCE_COMPLETIONS)
        * (workload.max_tokens / CPU_REFERENCE_MAX_TOKENS)
        * (params / CPU_REFERENCE_PARAMS)
    )


def wall_hours(run_hours: Sequence[float], parallel: int) -> float:
    """Hours until the last of the runs ends when `parallel` run at once, started in order as slots free up."""
    slots = [0.0] * max(1, min(parallel, len(run_hours) or 1))
    for hours in run_hours:
        earliest = slots.index(min(slots))
        slots[earliest] += hours
    return max(slots)


@dataclass(frozen=True)
class RunEstimate:
    step_time_s: float | None
    hours: float | None  # start-up, model load, the steps and the held-out evaluation
    gpu_hours: float | None  # None for a remote backend (the service's GPUs) or with no step time
    startup_s: float | None = None
    model_load_s: float | None = None
    training_s: float | None = None
    eval_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_estimate(seconds: float | None, max_steps: int, workload: Workload, eval_completions: int = 0) -> RunEstimate:
    """A run's hours: start-up, reading the weights (here: not for a remote backend), `max_steps` steps of
    `seconds`, and the held-out evaluation before and after training (`eval_completions` each time, each
    costing about what a training completion's share of a step does)."""
    if seconds is None:
        return RunEstimate(None, None, None)
    params = workload.params if workload.params is not None else REFERENCE_PARAMS
    load = 0.0 if workload.remote else params * BYTES_PER_PARAM / LOAD_BYTES_PER_S
    training = seconds * max_steps
    evaluation = 2 * eval_completions * seconds / max(workload.completions, 1)
    hours = (STARTUP_S + load + training + evaluation) / 3600.0
    return RunEstimate(
        seconds, hours, None if workload.remote else hours * workload.gpus, STARTUP_S, load, training, evaluation
    )
