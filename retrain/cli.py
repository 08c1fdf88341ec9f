"""Thin entry: tool subcommands (`status`, `squeeze`) by name, everything else through Hydra."""

from __future__ import annotations

import importlib
import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from retrain.config import config_dir, register_configs
from retrain.errors import ConfigError, HubFetchError

# subcommand -> module with `main(argv) -> int`
SUBCOMMANDS = {"status": "retrain.status", "squeeze": "retrain.squeeze"}


def _hydra_entry(cfg: DictConfig) -> None:
    from retrain.run import run

    try:
        run(cfg)
    except Exception as error:
        user_error = _user_error(error)
        if user_error is None or HydraConfig.get().mode != RunMode.RUN:
            raise
        # a mistake in the config or an unreachable Hub: the message says what to do, no traceback
        logging.getLogger("retrain").error("retrain: %s", user_error)
        raise SystemExit(1) from None


def _user_error(error: BaseException | None) -> BaseException | None:
    """The ConfigError/HubFetchError behind an error (Hydra wraps errors raised in instantiate)."""
    while error is not None:
        if isinstance(error, (ConfigError, HubFetchError)):
            return error
        error = error.__cause__
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in SUBCOMMANDS:
        return int(importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:]) or 0)
    register_configs()
    sys.argv = [sys.argv[0], *args]
    hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")(_hydra_entry)()
    return 0
