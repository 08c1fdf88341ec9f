"""A counting semaphore shared by every process that names the same directory: N slot files, one lock each.

A slot is held with a POSIX record lock (`fcntl.lockf`), which the kernel drops when its process dies
(no stale slot after a kill) and which NFS honours through its lock manager, so runs of a campaign on
one host or on several hosts sharing the directory never exceed N requests in flight together. Record
locks belong to a process, not to a thread or a file descriptor, so each process opens every slot
file once, keeps it open (closing any descriptor of a file drops the process's locks on it), and
hands slots to its own threads under a thread lock.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrain.errors import ConfigError

POLL_FIRST_S = 0.005  # first wait between attempts when every slot is taken; doubles up to POLL_MAX_S
POLL_MAX_S = 0.2


def default_lock_dir() -> Path:
    """<user cache dir>/retrain/tinker-slots ($XDG_CACHE_HOME or ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "retrain" / "tinker-slots"


class _ProcessSlots:
    """This process's open slot files of one directory, and which of them its threads hold."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: dict[int, int] = {}  # slot -> descriptor, open for the life of the process
        self.held: set[int] = set()
        self.lock = threading.Lock()

    def try_acquire(self, slots: int) -> int | None:
        with self.lock:
            for slot in range(slots):
                if slot in self.held:
                    continue
                descriptor = self.files.get(slot)
                if descriptor is None:
                    descriptor = self.files[slot] = os.open(
                        self.directory / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT
                    )
                try:
                    fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # another process holds it
                    continue
                self.held.add(slot)
                return slot
        return None

    def release(self, slot: int) -> None:
        with self.lock:
            fcntl.lockf(self.files[slot], fcntl.LOCK_UN)
            self.held.discard(slot)


_PROCESS_SLOTS: dict[Path, _ProcessSlots] = {}
_REGISTRY_LOCK = threading.Lock()


class FileSemaphore:
    """At most `slots` holders at once among all threads of all processes using `directory`."""

    def __init__(self, directory: Path, slots: int, key: str = "backend.lock_dir") -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"{key}={str(directory)!r} cannot be created: {error}") from error
        self.slots = slots
        with _REGISTRY_LOCK:
            self._process = _PROCESS_SLOTS.setdefault(directory.resolve(), _ProcessSlots(directory.resolve()))

    @contextmanager
    def slot(self) -> Iterator[int]:
        """Hold one slot (blocking until one is free) for the body of the `with`."""
        wait = POLL_FIRST_S
        while (slot := self._process.try_acquire(self.slots)) is None:
            time.sleep(wait)
            wait = min(wait * 2, POLL_MAX_S)
        try:
            yield slot
        finally:
            self._process.release(slot)
