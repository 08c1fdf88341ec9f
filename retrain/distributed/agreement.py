"""What the ranks of one run must share before they train: every setting that decides their work or collectives, and
the data they read.

Ranks are started by one command line, but each composes its own config (a per-rank environment, a wrapper that
adds an override) and reads its own files (a relative `data.path` from its own working directory). A rank whose
`eval.every` differs calls collectives the others never call (a hang until the collective timeout); one whose
`training.max_steps` or `eval.num_examples` differs gathers tensors of other shapes; one that reads other examples
trains on a batch the others never drew. So every setting is compared across ranks except the few that only change
what this process prints or how fast it computes (`RANK_LOCAL`, an allowlist: a new key is compared by default),
and so is a fingerprint of the examples each rank loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from retrain.distributed.world import gather_objects
from retrain.errors import ConfigError
from retrain.housekeeping.secrets import shown_config
from retrain.types import Example

# what may differ between the ranks of one run: what a rank logs (rank 0 alone writes), its CPU threads, its
# scoring worker processes; a key (or a section, by its name) not listed here must be the same on every rank
RANK_LOCAL = ("logging", "training.threads", "scoring.workers")


def rank_settings(cfg: DictConfig) -> dict[str, Any]:
    """`cfg` as dotted keys (as shown: no secret or environment value), less the rank-local ones and Hydra's own
    settings (the launch's: its output dirs, which rank 0 decides for all)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif not any(prefix == local or prefix.startswith(f"{local}.") for local in RANK_LOCAL):
            flat[prefix] = node

    walk(shown_config(OmegaConf.masked_copy(cfg, [str(key) for key in cfg if key != "hydra"])), "")
    return flat


def check_same_settings(cfg: DictConfig) -> None:
    """Every rank composed the same settings (`rank_settings`): a ConfigError naming the keys that differ, each with
    its value on rank 0 and on the ranks that differ."""
    ranks = gather_objects(rank_settings(cfg))
    main = ranks[0]
    differing: dict[str, list[int]] = {}
    for rank, settings in enumerate(ranks[1:], start=1):
        for key in sorted(main.keys() | settings.keys()):
            if main.get(key, "<unset>") != settings.get(key, "<unset>"):
                differing.setdefault(key, []).append(rank)
    if differing:
        lines = "; ".join(
            f"{key}={main.get(key, '<unset>')!r} on rank 0 but "
            + ", ".join(f"{ranks[rank].get(key, '<unset>')!r} on rank {rank}" for rank in where)
            for key, where in differing.items()
        )
        raise ConfigError(
            f"the ranks of one run were launched with other settings: {lines}. Every rank must compute the same "
            f"step, so only {', '.join(RANK_LOCAL)} may differ between ranks"
        )


def data_fingerprint(train: Sequence[Example] | None, size: int, held_out: Sequence[Example]) -> str:
    """A hash of the examples a rank loaded: all its training examples when the data source lists them
    (`train_examples`), else their number, and its held-out problems."""
    digest = hashlib.sha256(f"{size} training examples\n".encode())
    for part, examples in (("train", train or ()), ("held out", held_out)):
        for example in examples:
            fields = [part, example.prompt, example.reference, example.id, example.extra]
            digest.update(json.dumps(fields, sort_keys=True, default=str).encode() + b"\n")
    return digest.hexdigest()


def check_same_data(cfg: DictConfig, data: Any, held_out: Sequence[Example]) -> None:
    """Every rank loaded the same examples (`data_fingerprint`): a ConfigError naming the data setting and the ranks
    that loaded others (a relative `data.path` is read from each rank's working directory)."""
    fingerprint = data_fingerprint(getattr(data, "train_examples", None), len(data), held_out)
    ranks = gather_objects(fingerprint)
    differing = [rank for rank, other in enumerate(ranks) if other != ranks[0]]
    if differing:
        setting = f"data.path={cfg.data.path!r}" if "path" in cfg.data else f"data={cfg.data._target_}"
        raise ConfigError(
            f"{setting}: ranks {differing} loaded other examples than rank 0 (every rank must read the same data; a "
            "relative path is read from each rank's working directory, and a file may differ between nodes)"
        )
