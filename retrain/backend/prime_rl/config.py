"""Schema of `backend=prime_rl` (conf/backend/prime_rl.yaml); the backend itself is retrain.backend.prime_rl.backend.

Kept free of msgspec and pyzmq, so composing a config and `retrain backends` work without the extra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retrain.backend.option_rules import at_least, must_be_true, positive, within

TRANSPORTS = ("filesystem", "zmq")


@dataclass
class PrimeRlBackendConfig:
    """An external PRIME-RL trainer + inference server; retrain plays PRIME-RL's orchestrator."""

    _target_: str = "retrain.backend.prime_rl.backend.PrimeRlBackend"
    output_dir: str = field(
        default="",
        metadata={
            "help": "the PRIME-RL trainer's output_dir, where it reads rollouts/ and writes broadcasts/ "
            "(e.g. backend.output_dir=/runs/prime-rl)",
            "required": True,
        },
    )
    inference_url: str = field(
        default="http://localhost:8000", metadata={"help": "the PRIME-RL inference server (vLLM, OpenAI-compatible)"}
    )
    transport: str = field(
        default="filesystem",
        metadata={"choices": TRANSPORTS, "help": "PRIME-RL rollout_transport: rollouts/step_N files or ZMQ"},
    )
    zmq_host: str = field(default="localhost", metadata={"help": "host the ZMQ data socket binds (transport=zmq)"})
    zmq_port: int = field(
        default=5555,
        metadata={
            "help": "ZMQ data port; the trainer ranks' READY barrier uses zmq_port + 1",
            "validator": within(1, 65534, "zmq_port + 1 is used too"),
        },
    )
    zmq_hwm: int = field(
        default=10, metadata={"help": "ZMQ high-water mark (messages in flight per socket)", "validator": at_least(1)}
    )
    strict_advantages: bool = field(
        default=True,
        metadata={
            "help": "must stay true: each token's advantage is sent as computed, never averaged; false is rejected",
            "validator": must_be_true(
                "retrain never averages a row's token-level advantages into one (PRIME-RL's loss takes them per "
                "token, and each is sent as computed); keep it true or leave it out"
            ),
        },
    )
    sync_wait_s: float = field(
        default=30.0,
        metadata={
            "help": "max seconds to wait for a step's broadcast (STABLE) or the trainer's READY",
            "validator": positive,
        },
    )
    sync_poll_s: float = field(
        default=0.2, metadata={"help": "seconds between checks for the broadcast's STABLE", "validator": positive}
    )
    seq_len: int = field(
        default=8192,
        metadata={
            "help": "tokens per packed micro-batch: the PRIME-RL orchestrator's seq_len",
            "validator": at_least(1),
        },
    )
    num_train_workers: int = field(
        default=1,
        metadata={"help": "the PRIME-RL trainer's data-parallel ranks (one rank_R.bin each)", "validator": at_least(1)},
    )
