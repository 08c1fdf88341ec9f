"""`torchrun ... tests/distributed/per_rank.py <overrides>`: retrain's CLI on every rank, except that rank 1 adds the
overrides in RANK1_OVERRIDES (separated by spaces) and starts in RANK1_CWD, as a per-rank launch script or
environment would make one rank's settings or files differ (tests/distributed/test_rank_agreement.py)."""

from __future__ import annotations

import os
import sys

from retrain.cli import main

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        sys.argv += os.environ.get("RANK1_OVERRIDES", "").split()
        os.chdir(os.environ.get("RANK1_CWD") or ".")
    raise SystemExit(main())
