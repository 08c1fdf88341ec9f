"""The multirun.yaml of a sweep, written with its secrets masked.

Hydra's basic sweeper saves the sweep's config as typed (the config, its command-line overrides and
`override_dirname`), so a key typed on the command line (`'+reward.api_key=sk-...'`) or a url's
credentials would sit in the sweep dir. The jobs are composed from their overrides, never from that
file, so masking it (retrain.housekeeping.secrets) changes nothing they run with. Hydra only loads sweepers from
its `hydra_plugins` package, so the CLI has `OmegaConf.save` mask that one file while it runs
(hydra-core is pinned to 1.3.x, whose BasicSweeper.sweep saves it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from retrain.housekeeping.secrets import masked_config, masked_override

MULTIRUN_FILE = "multirun.yaml"


def masked_sweep_config(config: Any) -> Any:
    """The sweep's config with its secrets masked: values by key or shape, the overrides one by one."""
    masked = masked_config(config)
    overrides = masked.hydra.overrides
    overrides.task = [masked_override(str(override)) for override in overrides.task]
    return masked


@contextmanager
def multirun_file_masked() -> Iterator[None]:
    """While a command runs, OmegaConf.save writes a multirun.yaml masked (anything else as it is).

    The save itself is patched, not the sweeper's module: Hydra re-executes its plugin modules when it
    scans them, which would undo a patch of their names."""
    original = OmegaConf.__dict__["save"]  # the staticmethod itself, put back as it was
    save = OmegaConf.save

    def save_masked(config: Any, f: Any, resolve: bool = False) -> None:
        if isinstance(f, (str, Path)) and Path(f).name == MULTIRUN_FILE:
            config = masked_sweep_config(config)
        save(config, f, resolve=resolve)

    OmegaConf.save = staticmethod(save_masked)  # type: ignore[method-assign]
    try:
        yield
    finally:
        OmegaConf.save = original  # type: ignore[method-assign]
