"""Data-parallel runs on real torch.distributed process groups (gloo on the CPU)."""

import sys

# torchrun itself (its console script is torch.distributed.run:main), found with the interpreter running the
# tests rather than on PATH, which a virtualenv used without activating does not change; --standalone: its
# rendezvous on a free local port, as two launches at once (two test workers) cannot share torchrun's 29500
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
