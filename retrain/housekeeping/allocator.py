"""Host memory that a step frees stays in the process for the next step (glibc's malloc, Linux).

glibc serves a large allocation (above a threshold that starts at 128 KiB and rises with use) with fresh
pages mapped from the kernel and unmaps them on free, and it hands the free top of its heap back to the
kernel beyond a trim threshold. A training step allocates and frees the same activations every step, so
each step paid for its memory again as page faults on fresh zeroed pages: ~170k per small64 fp32 training
step (~650 MB), ~9% of it (docs/benchmarks.md). With the threshold fixed at glibc's maximum (32 MiB) and
no trimming, a step reuses the memory of the step before: no faults after the first, the same peak.
Numbers are unchanged (torch aligns its blocks itself). Elsewhere (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest glibc accepts on 64-bit
NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above (for allocations from now on); False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)  # the C library this process runs on
    if not hasattr(libc, "gnu_get_libc_version"):  # musl has no mallopt to speak of
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
