"""CUDA's caching allocator, set up for RL steps: expandable segments, unless the user configured it.

A step alternates sampling (a KV pool sized per call, the decode step's logits) and training (activations that
grow with the step's longest row). With fixed-size segments the allocator keeps blocks cut to one phase's sizes,
and the next phase's larger requests fragment around them, or trigger a free-all-and-retry (an allocator retry,
a full synchronisation). Expandable segments map more pages into one segment as it grows, so the memory one
phase frees serves the next (PyTorch: "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF").

torch reads the setting when CUDA initialises, so it is set at the start of a run, before the world joins and
a device is chosen; a user's own PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, and its older CUDA one
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def use_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask CUDA's allocator for expandable segments where the user did not configure it; whether this did."""
    if any(name in environ for name in ALLOC_CONF_VARIABLES):
        return False
    environ[ALLOC_CONF_VARIABLES[0]] = EXPANDABLE_SEGMENTS
    return True
