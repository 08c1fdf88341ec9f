"""Thin entry: tool subcommands (`status`, `squeeze`) by name, everything else through Hydra."""

from __future__ import annotations

import importlib
import sys

import hydra
from omegaconf import DictConfig

from retrain.config import config_dir, register_configs

# subcommand -> module with `main(argv) -> int`
SUBCOMMANDS = {"status": "retrain.status", "squeeze": "retrain.squeeze"}


def _hydra_entry(cfg: DictConfig) -> None:
    from retrain.run import run

    run(cfg)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in SUBCOMMANDS:
        return int(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]) or 0)
    register_configs()
    sys.argv = [sys.argv[0], *args]
    hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")(_hydra_entry)()
    return 0
