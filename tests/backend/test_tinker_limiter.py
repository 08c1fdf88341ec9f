"""backend.max_concurrent_calls: a slot-file semaphore that real processes (and threads) share."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from retrain.backend.tinker.limiter import FileSemaphore
from tests.conftest import cli_env

HOLD_S = 0.4
HOLDER = """
import sys, time
from pathlib import Path
from retrain.backend.tinker.limiter import FileSemaphore
slots = FileSemaphore(Path(sys.argv[1]), int(sys.argv[2]))
with slots.slot():
    start = time.time()
    time.sleep(float(sys.argv[3]))
    print(start, time.time())
"""


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, change in edges:
        running += change
        peak = max(peak, running)
    return peak


def test_processes_sharing_a_lock_dir_never_hold_more_slots_than_allowed(tmp_path: Path) -> None:
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(tmp_path), "2", str(HOLD_S)],
            stdout=subprocess.PIPE,
            text=True,
            env=cli_env(),
        )
        for _ in range(5)
    ]
    outputs = [worker.communicate(timeout=60)[0] for worker in workers]
    assert all(worker.returncode == 0 for worker in workers)
    intervals = [tuple(map(float, output.split())) for output in outputs]
    assert most_at_once(intervals) == 2  # the limit, and reached
    assert max(end for _, end in intervals) - min(start for start, _ in intervals) >= 3 * HOLD_S * 0.95


def test_a_killed_holder_frees_its_slot(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), "1", "60"], stdout=subprocess.PIPE, env=cli_env()
    )
    deadline = time.time() + 30
    slots = FileSemaphore(tmp_path, 1)
    held_by_child = False
    while not held_by_child and time.time() < deadline:  # wait until the child holds the only slot
        if slots._process.try_acquire(1) is None:
            held_by_child = True
        else:
            slots._process.release(0)
            time.sleep(0.05)
    assert held_by_child
    holder.kill()
    holder.wait()
    with slots.slot() as slot:
        assert slot == 0


def test_threads_of_one_process_share_the_limit(tmp_path: Path) -> None:
    slots = FileSemaphore(tmp_path, 2)
    other = FileSemaphore(tmp_path, 2)  # a second user in the same process: the same slots
    intervals: list[tuple[float, float]] = []

    def hold(semaphore: FileSemaphore) -> None:
        with semaphore.slot():
            start = time.time()
            time.sleep(0.1)
            intervals.append((start, time.time()))

    threads = [threading.Thread(target=hold, args=(s,)) for s in (slots, other) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most_at_once(intervals) == 2
