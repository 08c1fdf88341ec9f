"""A rank that fails says so where rank 0 looks: the run's status names the failing rank and its error.

Rank 0 alone writes run.log and status.json, but when another rank raises, rank 0 learns only that a peer is gone
(its collective fails: at once under gloo, within the process group's timeout under NCCL). So the failing rank
leaves one line, its secrets masked (retrain.housekeeping.secrets), in `<run dir>/ranks/<attempt>/rank<r>.failed`
before it exits, and rank 0, failing next, records that line in status.json and run.log instead of its own
"connection closed", and raises it as `RankFailed`, so what the job returns (the campaign's exit.json, the console)
names the same cause. `attempt` is one launch's own id (rank 0's, agreed by all), so an earlier launch's notes are
never blamed; rank 0 clears those once it holds the run dir.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retrain.distributed.world import World
from retrain.error_lines import failure_line
from retrain.housekeeping.rundir import RunDir
from retrain.housekeeping.secrets import mask_text

log = logging.getLogger("retrain")

NOTES = "ranks"  # under the run dir


class RankFailed(RuntimeError):
    """Another rank failed, and rank 0's own error only says that its peer is gone: the failed ranks' lines."""


def clear_earlier_notes(run_dir: Path, attempt: str) -> None:
    """Forget earlier launches' failed ranks (rank 0, once the run dir is this run's)."""
    for old in (run_dir / NOTES).glob("*"):
        if old.name != attempt:
            shutil.rmtree(old, ignore_errors=True)


def peer_failures(notes: Path) -> list[str]:
    """`rank r: <error>` of every rank that left a note in `notes`, by rank."""
    found = sorted(notes.glob("rank*.failed"), key=lambda p: int(p.stem.removeprefix("rank")))
    return [f"{note.stem.replace('rank', 'rank ')}: {note.read_text().strip()}" for note in found]


@contextmanager
def rank_failures_recorded(run_dir: Path, world: World, attempt: str) -> Iterator[None]:
    """Another rank: note its error for rank 0. Rank 0: record the failed ranks' errors (when any) as the run's."""
    notes = run_dir / NOTES / attempt
    try:
        yield
    except BaseException as error:
        if not world.distributed:
            raise
        if not world.is_main:
            notes.mkdir(parents=True, exist_ok=True)
            note = mask_text(failure_line(error))  # the error may quote a url with its password
            (notes / f"rank{world.rank}.failed").write_text(note + "\n")
            raise
        failed = peer_failures(notes)
        if failed:
            line = f"{'; '.join(failed)} (rank 0: {type(error).__name__})"
            log.error("data-parallel run failed: %s", line)
            RunDir(run_dir).record_failure(line)
            if isinstance(error, Exception):  # an interrupt stays one
                raise RankFailed(line) from error
        raise
