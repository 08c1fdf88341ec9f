"""Schema of `backend=tinker` (conf/backend/tinker.yaml starts from it as `base_tinker`).

The API key is never a config key: it is read from the environment variable TINKER_API_KEY only, so
it cannot reach a saved config, a log line, wandb or a run's identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retrain.backend.option_rules import at_least, zero_or_at_least

MIN_SAMPLER_TTL_S = 3600  # the service refuses a shorter lifetime


@dataclass
class TinkerBackendConfig:
    """The Tinker service: where it is, how hard a campaign may call it, how long sampler weights live."""

    _target_: str = "retrain.backend.tinker.backend.TinkerBackend"
    base_url: str = field(
        default="",
        metadata={"help": "Tinker service URL; empty: $TINKER_BASE_URL, else the SDK's default endpoint"},
    )
    max_concurrent_calls: int = field(
        default=4,
        metadata={
            "help": "Tinker requests in flight at once across every run on this host or shared lock_dir",
            "validator": at_least(1),
        },
    )
    lock_dir: str = field(
        default="",
        metadata={
            "help": "directory of the slot lock files that enforce max_concurrent_calls (a shared filesystem "
            "limits runs on several hosts); empty: <user cache dir>/retrain/tinker-slots"
        },
    )
    max_retries: int = field(
        default=4,
        metadata={
            "help": "retries of a request the SDK reports as retryable (429, 5xx, timeouts)",
            "validator": at_least(0),
        },
    )
    retry_backoff_s: float = field(
        default=2.0,
        metadata={"help": "first retry delay; doubles on each retry, at most 60 s", "validator": at_least(0)},
    )
    sampler_ttl_s: int = field(
        default=86400,
        metadata={
            "help": f"lifetime of each step's sampler weights on the service (>= {MIN_SAMPLER_TTL_S}); 0 keeps them forever",
            "validator": zero_or_at_least(MIN_SAMPLER_TTL_S, "never expire"),
        },
    )
