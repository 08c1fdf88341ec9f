"""`training.max_staleness`: how many optimizer steps the sampler may run ahead of the trainer (docs/async.md).

Resolved and checked before any model loads. Sampling ahead needs an engine with a device of its own: a server
(vllm_server, sglang, openai: engines that declare `own_device`), or an in-process engine in split mode
(`backend.devices` naming two devices, the engine sampling with its own copy of the weights). An engine that samples
on the trainer's device with the trainer's weights (pytorch or vllm in-process on one device) would sample with
weights changing under it, so it is refused, naming the key.
"""

from __future__ import annotations

from retrain.errors import ConfigError
from retrain.plugins import plugin_name

KEY = "training.max_staleness"


def split_mode(devices: str) -> bool:
    """Whether `backend.devices` names two devices (inference, training): split mode (retrain.backend.devices)."""
    return len([spec for spec in devices.split(",") if spec.strip()]) == 2


def resolve_max_staleness(
    configured: int | None, *, devices: str, engine_cls: type, samples_itself: bool, ranks: int
) -> int:
    """The run's staleness bound k: the configured one, checked against the run's parts, or by engine when null (1 in
    split mode, which has always sampled one step ahead; 0 elsewhere). ConfigError naming the key when the parts
    cannot sample ahead."""
    split = split_mode(devices) and not samples_itself
    if configured is None:
        return 1 if split and ranks == 1 else 0
    if configured == 0:
        return 0
    where = f"{KEY}={configured}"
    if samples_itself:
        raise ConfigError(
            f"{where}: backend {plugin_name(engine_cls)} samples itself, and retrain cannot run its sampling ahead "
            f"yet (docs/async.md); set {KEY}=0"
        )
    if not (split or getattr(engine_cls, "own_device", False)):
        raise ConfigError(
            f"{where}: inference engine {plugin_name(engine_cls)} samples on the trainer's device with the trainer's "
            "weights, so it cannot sample while the trainer trains; use split mode (backend.devices='gpu:0,gpu:1') "
            f"or a server engine (vllm_server, sglang, openai), or set {KEY}=0 (docs/async.md)"
        )
    return configured
