"""Where a local backend samples and trains: `backend.devices` as torch devices (one, or two in split mode)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from retrain.errors import ConfigError
from retrain.housekeeping.digits import whole_number


@dataclass(frozen=True)
class DevicePlan:
    """Where sampling and training run: one device (colocated), or two (split mode)."""

    inference: torch.device
    training: torch.device
    split: bool = False  # two devices: sampling of the next step overlaps training of this one (policy lag <= 1)


def resolve_devices(devices: str) -> DevicePlan:
    """`backend.devices` → the devices: "cpu" or "gpu:N" for both sides; "gpu:I,gpu:T" splits
    inference (first) from training (last) and needs two GPUs; "cpu,cpu" splits on the CPU (the
    overlap logic without GPUs, for tests)."""
    specs = [spec.strip() for spec in devices.split(",") if spec.strip()]
    if len(specs) <= 1:
        device = resolve_device(devices)
        return DevicePlan(inference=device, training=device)
    if len(specs) > 2:
        raise ConfigError(f"backend.devices={devices!r}: give one device, or two for split mode (inference,training)")
    if specs == ["cpu", "cpu"]:
        return DevicePlan(inference=torch.device("cpu"), training=torch.device("cpu"), split=True)
    if any(not spec.startswith("gpu:") for spec in specs) or specs[0] == specs[1]:
        raise ConfigError(
            f"backend.devices={devices!r}: split mode needs two different GPUs, e.g. gpu:0,gpu:1 "
            "(inference on the first, training on the last)"
        )
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < 2:
        raise ConfigError(
            f"backend.devices={devices!r}: split mode needs two GPUs, but {visible} CUDA device(s) are "
            "visible; give one device (e.g. backend.devices=gpu:0)"
        )
    return DevicePlan(inference=resolve_device(specs[0]), training=resolve_device(specs[1]), split=True)


def resolve_device(devices: str) -> torch.device:
    """One `backend.devices` entry → the torch device: "cpu", or "gpu:N" (CPU with a warning when CUDA is absent)."""
    specs = [spec.strip() for spec in devices.split(",") if spec.strip()]
    if len(specs) > 1:
        return resolve_devices(devices).training
    spec = specs[0] if specs else ""
    if spec == "cpu":
        return torch.device("cpu")
    kind, _, index = spec.partition(":")
    if kind != "gpu" or whole_number(index) is None:
        raise ConfigError(f"backend.devices={devices!r} is not 'cpu' or 'gpu:N'")
    if not torch.cuda.is_available():
        warnings.warn(
            f"backend.devices={devices!r} but CUDA is not available: falling back to CPU (fp32)",
            RuntimeWarning,
            stacklevel=2,
        )
        return torch.device("cpu")
    if int(index) >= torch.cuda.device_count():
        raise ConfigError(f"backend.devices={devices!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return torch.device("cuda", int(index))
