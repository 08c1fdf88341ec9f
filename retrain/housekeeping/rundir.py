"""The layout of a run dir, written down once: every file a run leaves, and how each is read and written.

    <run dir>/
      status.json                  where the run stands (rewritten after every step)
      metrics.jsonl                one record per step
      emergence/steps.jsonl        per-step planning statistics
      emergence/generations.jsonl  a few completions per step
      checkpoints/step_N/          a checkpoint after N completed steps (the backend's files, e.g. a PEFT
                                   adapter and optimizer.pt; trainer_state.json, checksums.json)
      final/                       the checkpoint written when the run finishes
      <checkpoint>.damaged-<time>  a checkpoint found unreadable on restart, set aside (never listed, never deleted)
      .<checkpoint>.<stage>-<pid>  a checkpoint being written, replaced or pruned (hidden; tidied on restart)
      run.log                      the console log (Hydra's file handler, conf/config.yaml)
      job.json, exit.json          each attempt's start (once it holds the dir) and how Hydra's job returned
      .hydra/                      Hydra's composed config (written by retrain/housekeeping/launch.py, secrets masked)
      .retrain.lock                held by the process training in this dir
      run_identity.json            the config identity of the run this dir holds (retrain/housekeeping/launch.py)

The run may be read from another process, another node, or after it died, so every write is atomic:
a JSON file goes through a temp file + fsync + rename; a checkpoint is written into a hidden temp
dir, fsynced and renamed into place, with `trainer_state.json` and then `checksums.json` (the sha256
of every other file) written last, so a killed run never leaves a half-written checkpoint that a
restart would trust. A checkpoint written again (final/ of a continued run) replaces the old one by
renaming the old one aside first, and an old one pruned (`training.keep_checkpoints`) is renamed
aside before it is deleted: a kill at any point leaves a whole checkpoint under its name, or a hidden
dir that the restart puts back or removes. A save the filesystem refuses (a full disk) removes its
temp dir and ends the run with one message naming the checkpoint it can resume from. A restart
reads every file of the newest checkpoint and checks its digests before trusting it, and falls back
past damaged ones (a file truncated, zeroed or overwritten outside retrain, or missing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from retrain.errors import CheckpointError
from retrain.housekeeping.digits import whole_number
from retrain.housekeeping.file_modes import follow_umask
from retrain.housekeeping.trainer_state import TrainerState
from retrain.model.peft_files import ADAPTER_WEIGHTS

log = logging.getLogger(__name__)

STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
EMERGENCE_STEPS = "emergence/steps.jsonl"
EMERGENCE_GENERATIONS = "emergence/generations.jsonl"
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step_"
FINAL = "final"
STATE_FILE = "trainer_state.json"
CHECKSUMS_FILE = "checksums.json"  # {path: sha256} of every other file, written last (none: an older checkpoint)
LOG_FILE = "run.log"
JOB_FILE = "job.json"
EXIT_FILE = "exit.json"
HYDRA_DIR = ".hydra"
LOCK_FILE = ".retrain.lock"
IDENTITY_FILE = "run_identity.json"
DAMAGED_MARK = ".damaged-"  # `step_8.damaged-20250101T120000`: no step dir's name, so never listed again
# hidden dirs of a checkpoint save under way, `.<name>.<stage>-<pid>`: being written, the old one being replaced,
# an old one being pruned; a kill leaves them behind, and the restart removes them (or puts a replaced one back)
STAGING, REPLACED, PRUNED = "tmp", "replaced", "pruned"
HIDDEN_CHECKPOINT = re.compile(rf"^\.(?P<name>.+)\.(?P<stage>{STAGING}|{REPLACED}|{PRUNED})-\d+$")
DISK_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full
RELISTS = 5  # listings of a live run's checkpoints read before its rotating them is reported (resumable_checkpoint)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON through a temp file + fsync + rename, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_text_file(path: Path) -> str:
    """A file's text; OSError naming it when a FIFO or a device stands in its place (reading one could
    block forever or never end). A directory raises IsADirectoryError, as reading it always did."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise OSError(f"{path} is not a regular file (a FIFO, socket or device)")
    return path.read_text()


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file, or None when it is absent or caught mid-write by a non-atomic writer."""
    try:
        return json.loads(read_text_file(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def checksum_mismatch(directory: Path) -> str | None:
    """Which file of `directory` differs from its sha256 in its checksums.json; None when all match or none
    were recorded (a checkpoint or an adapter dir written before checksums)."""
    checksums = directory / CHECKSUMS_FILE
    if not checksums.is_file():
        return None
    try:
        recorded = json.loads(read_text_file(checksums))
    except (OSError, ValueError) as error:  # ValueError: JSON or UTF-8 that does not decode
        return f"{CHECKSUMS_FILE} does not read ({type(error).__name__}: {error})"
    if not isinstance(recorded, dict):
        return f"{CHECKSUMS_FILE} holds a {type(recorded).__name__}, not the digests of the files"
    for name, digest in sorted(recorded.items()):
        file = directory / name
        if not file.is_file():
            return f"{name} is missing (listed in {CHECKSUMS_FILE})"
        if _sha256(file) != digest:
            return f"{name} does not match its sha256 in {CHECKSUMS_FILE} (changed after it was saved)"
    return None


def _step_number(name: str) -> int | None:
    """N of a `step_N` dir name; None for any other name."""
    digits = name.removeprefix(STEP_PREFIX)
    return whole_number(digits) if name.startswith(STEP_PREFIX) else None


def _read_safetensors(path: Path) -> None:
    from safetensors import safe_open  # imported here: `retrain status` reads run dirs without torch

    with safe_open(str(path), framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
            weights.get_tensor(key)


def _read_torch(path: Path) -> None:
    import torch

    torch.load(path, map_location="cpu", weights_only=True)


# how each kind of file in a checkpoint is read whole: a file that fails its reader makes the checkpoint damaged
CHECKPOINT_READERS: dict[str, Callable[[Path], Any]] = {
    ".json": lambda path: json.loads(path.read_text()),
    ".safetensors": _read_safetensors,
    ".pt": _read_torch,
}


def _filesystem_refusal(error: BaseException, where: Path) -> str | None:
    """Why the filesystem refused a write into `where`; None when `error` is no refusal (a bug). A refusal is
    an OSError raised or caught on the way (torch wraps the one its file writer hit), or a disk left full
    (safetensors and torch's path writer report a full disk without an OSError)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    try:
        full = shutil.disk_usage(where).free < DISK_FULL_BYTES
    except OSError:
        return None
    return f"no space left on the device holding {where} ({type(error).__name__}: {error})" if full else None


def _fsync_tree(root: Path) -> None:
    for file in root.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(root)


def _fsync_dir(directory: Path) -> None:
    """Make the renames inside `directory` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _sha256(file: Path) -> str:
    with open(file, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _digests(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by path relative to it."""
    return {file.relative_to(root).as_posix(): _sha256(file) for file in sorted(root.rglob("*")) if file.is_file()}


def _hidden(checkpoint: Path, stage: str) -> Path:
    """The hidden dir beside `checkpoint` for one stage of a save by this process (HIDDEN_CHECKPOINT)."""
    return checkpoint.with_name(f".{checkpoint.name}.{stage}-{os.getpid()}")


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing `target` is renamed aside first and deleted only after, so a kill
    in between leaves the old checkpoint whole under its hidden name (RunDir.tidy_interrupted_saves puts it back)."""
    old = _hidden(target, REPLACED) if target.exists() else None
    if old is not None:
        if old.exists():
            shutil.rmtree(old)
        os.rename(target, old)
    os.replace(new, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint dir: model files written by the backend, plus the trainer's state."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def is_final(self) -> bool:
        return self.path.name == FINAL

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE

    @property
    def is_complete(self) -> bool:
        """The state is written last, so a dir without it was never finished (or copied half-way)."""
        return self.state_file.is_file()

    @property
    def completed_steps(self) -> int:
        """Steps done when it was saved: a step dir's name says so without reading it; final/ its state."""
        number = _step_number(self.path.name)
        return number if number is not None else int(self.state()["completed_steps"])

    def state(self) -> dict[str, Any]:
        with open(self.state_file) as handle:
            return json.load(handle)

    def damage(self, required: tuple[str, ...]) -> str | None:
        """What makes this checkpoint unfit to restore, or None when every file in it reads whole.

        Reads the files without building a model: the state parses and has every key a restore reads,
        the backend's `required` files (`Backend.checkpoint_files`) are there, every JSON,
        safetensors and torch file loads, and every file matches its sha256 in checksums.json (damage
        that still loads: a zeroed block of weights). A checkpoint written before checksums has none to check.
        """
        try:
            state = self.state()
        except (OSError, ValueError) as error:  # ValueError: JSON or UTF-8 that does not decode
            return f"{STATE_FILE} does not read ({type(error).__name__}: {error})"
        if not isinstance(state, dict):
            return f"{STATE_FILE} holds a {type(state).__name__}, not the trainer's state"
        if missing := TrainerState.missing(state):
            return f"{STATE_FILE} lacks {', '.join(missing)}"
        for name in required:
            if not (self.path / name).is_file():
                return f"{name} is missing"
        try:
            files = sorted(self.path.iterdir())
        except OSError as error:  # removed while it was read (a live run pruning it): resumable_checkpoint relists
            return f"does not list ({type(error).__name__}: {error})"
        for file in files:
            reader = CHECKPOINT_READERS.get(file.suffix)
            if reader is None:
                continue
            try:
                reader(file)
            except Exception as error:  # each library has its own errors for a truncated or garbled file
                return f"{file.name} does not read ({type(error).__name__}: {error})"
        return self._checksum_mismatch()

    def _checksum_mismatch(self) -> str | None:
        """Which file differs from the digest recorded when it was saved; None when all match (or none were)."""
        return checksum_mismatch(self.path)

    def set_aside(self) -> Path:
        """Rename a damaged checkpoint out of the listing (kept for a look, never deleted); returns its new path."""
        aside = self.path.with_name(f"{self.path.name}{DAMAGED_MARK}{time.strftime('%Y%m%dT%H%M%S')}")
        os.rename(self.path, aside)
        return aside

    @classmethod
    def write(cls, target: Path, write_payload: Callable[[Path], None], state: dict[str, Any]) -> Checkpoint:
        """Create or replace `target` atomically: `write_payload(tmp_dir)` writes the model files, then the
        state, then the digests of both.

        A failed write leaves no temp dir behind; one the filesystem refused (a full disk) raises a
        CheckpointError that names the newest intact checkpoint, so a rerun resumes from it.
        """
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _hidden(target, STAGING)
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            tmp.mkdir()
            write_payload(tmp)
            write_json_atomic(tmp / STATE_FILE, {**state, "checkpoint_path": str(target)})
            write_json_atomic(tmp / CHECKSUMS_FILE, _digests(tmp))
            follow_umask(tmp)
            _fsync_tree(tmp)
        except BaseException as error:
            refusal = _filesystem_refusal(error, target.parent) if isinstance(error, Exception) else None
            shutil.rmtree(tmp, ignore_errors=True)
            if refusal is not None:
                raise CheckpointError(_unwritten(target, refusal)) from error
            raise
        _replace_dir(tmp, target)
        return cls(target)


def _unwritten(target: Path, refusal: str) -> str:
    """The one message of a checkpoint the filesystem refused: why, and where a rerun resumes from."""
    intact = RunDir.of_checkpoint(target).latest_checkpoint()
    if intact is None:
        then = "no earlier checkpoint of this run exists: rerunning the same command starts it again"
    else:
        then = f"{intact.path} is intact: rerunning the same command resumes from it"
    return f"could not write checkpoint {target}: {refusal}; {then}"


def _newest_first(checkpoint: Checkpoint) -> tuple[float, bool]:
    """Sort key: steps done, final/ ahead on a tie; a final/ whose state does not read comes first, so that
    the restart that validates it finds it damaged instead of this sort failing."""
    try:
        return checkpoint.completed_steps, checkpoint.is_final
    except (OSError, ValueError, KeyError, TypeError):
        return math.inf, True


@dataclass(frozen=True)
class RunDir:
    """A run dir: the paths of its files, and their readers and writers."""

    path: Path

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> RunDir:
        """The run dir holding a checkpoint dir (`<run>/final` or `<run>/checkpoints/step_N`)."""
        parent = checkpoint.parent
        return cls(parent.parent if parent.name == CHECKPOINTS else parent)

    # ---- paths -------------------------------------------------------------------------------
    @property
    def status_file(self) -> Path:
        return self.path / STATUS_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def emergence_steps(self) -> Path:
        return self.path / EMERGENCE_STEPS

    @property
    def emergence_generations(self) -> Path:
        return self.path / EMERGENCE_GENERATIONS

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / CHECKPOINTS

    def checkpoint_dir(self, completed_steps: int) -> Path:
        return self.checkpoints_dir / f"{STEP_PREFIX}{completed_steps}"

    @property
    def final_dir(self) -> Path:
        return self.path / FINAL

    @property
    def final_adapter(self) -> Path:
        return self.final_dir / ADAPTER_WEIGHTS

    @property
    def log_file(self) -> Path:
        return self.path / LOG_FILE

    @property
    def job_file(self) -> Path:
        return self.path / JOB_FILE

    @property
    def exit_file(self) -> Path:
        return self.path / EXIT_FILE

    @property
    def hydra_dir(self) -> Path:
        return self.path / HYDRA_DIR

    @property
    def hydra_config(self) -> Path:
        return self.hydra_dir / "config.yaml"

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def identity_file(self) -> Path:
        return self.path / IDENTITY_FILE

    def has_run(self) -> bool:
        """Whether a run lives here: the trainer's status, the campaign callback's job file, or Hydra's dir."""
        return self.path.is_dir() and any(p.exists() for p in (self.status_file, self.job_file, self.hydra_dir))

    # ---- checkpoints -------------------------------------------------------------------------
    def step_dirs(self) -> list[Path]:
        """Every checkpoints/step_N dir, complete or not, highest N first (temp dirs are hidden, not listed)."""
        numbered = [
            (n, p)
            for p in self.checkpoints_dir.glob(f"{STEP_PREFIX}*")
            if (n := _step_number(p.name)) is not None and p.is_dir()
        ]
        return [p for _, p in sorted(numbered, key=lambda item: item[0], reverse=True)]

    def checkpoints(self) -> list[Checkpoint]:
        """Complete checkpoints, newest first: the one place that orders the candidates to restart from.

        Ordered by completed steps, final/ ahead of a step dir of the same count. final/ is not always
        the newest: a finished run continued with a higher max_steps writes newer step dirs beside it.
        """
        candidates = [Checkpoint(p) for p in (self.final_dir, *self.step_dirs())]
        complete = [c for c in candidates if c.is_complete]
        return sorted(complete, key=_newest_first, reverse=True)

    def latest_checkpoint(self) -> Checkpoint | None:
        """The most advanced complete checkpoint, if any."""
        found = self.checkpoints()
        return found[0] if found else None

    def resumable_checkpoint(self, *, set_aside: bool, required: tuple[str, ...]) -> Checkpoint | None:
        """The most advanced checkpoint that reads whole (`Checkpoint.damage`); None when there is none at all.

        Newer damaged ones are skipped with a warning naming them and, with `set_aside` (this run's own
        dir under its lock, not another run's that `resume.from` reads), renamed out of the listing, after
        the saves a kill interrupted are tidied (`tidy_interrupted_saves`). When every checkpoint is
        damaged nothing is renamed and a CheckpointError says what is wrong with each.

        A checkpoint gone by the time it is read was pruned or replaced by the live run writing this dir
        (`training.keep_checkpoints`), not damaged: the listing is read again, up to RELISTS times, so the
        checkpoint that replaced it is found; a run that keeps rotating them past that is said to be writing.
        """
        if set_aside:
            self.tidy_interrupted_saves()
        for _ in range(RELISTS):
            damaged: list[tuple[Checkpoint, str]] = []
            for checkpoint in self.checkpoints():
                why = checkpoint.damage(required)
                if why is None:
                    for bad, bad_why in damaged:
                        aside = f", set aside as {bad.set_aside().name}" if set_aside else ""
                        log.warning(
                            "checkpoint %s is damaged (%s)%s; resuming from %s",
                            bad.path,
                            bad_why,
                            aside,
                            checkpoint.path,
                        )
                    return checkpoint
                if not checkpoint.path.exists():
                    break  # rotated away while it was read: list again
                damaged.append((checkpoint, why))
            else:
                if damaged:
                    listed = "; ".join(f"{c.path}: {why}" for c, why in damaged)
                    raise CheckpointError(
                        f"no checkpoint in {self.path} can be restored ({listed}); repair or remove them to start "
                        "the run over, or resume.from=<an intact checkpoint>"
                    )
                return None
        raise CheckpointError(
            f"the checkpoints of {self.path} were removed as they were read, {RELISTS} times: a run is writing this "
            "dir and rotating them (training.keep_checkpoints); try again, or once it has stopped"
        )

    def tidy_interrupted_saves(self) -> None:
        """Undo what a kill during a save left (HIDDEN_CHECKPOINT): a checkpoint being replaced goes back under
        its name when the new one never got there; temp dirs, pruned and replaced leftovers are removed.

        Only for this run's own dir, under its lock: another process's save under way would look the same.
        """
        for parent in (self.path, self.checkpoints_dir):
            if not parent.is_dir():
                continue
            for hidden in sorted(parent.iterdir()):
                match = HIDDEN_CHECKPOINT.match(hidden.name)
                if match is None or not hidden.is_dir():
                    continue
                original = parent / match["name"]
                if match["stage"] == REPLACED and not original.exists() and Checkpoint(hidden).is_complete:
                    log.warning("a save of %s was killed while replacing it: putting the previous one back", original)
                    os.rename(hidden, original)
                else:
                    log.info("removing %s, left by a save that was killed", hidden)
                    shutil.rmtree(hidden)

    def prune_checkpoints(self, keep: int) -> None:
        """Delete all but the `keep` newest step checkpoints (`training.keep_checkpoints`; 0 keeps all).

        final/ is never counted nor deleted. Each goes through a hidden name first, so a kill mid-delete never
        leaves a half-deleted checkpoint that a restart would find damaged.
        """
        if keep <= 0:
            return
        for old in [c for c in self.checkpoints() if not c.is_final][keep:]:
            aside = _hidden(old.path, PRUNED)
            os.rename(old.path, aside)
            shutil.rmtree(aside)
            log.debug("removed %s (training.keep_checkpoints=%d)", old.path, keep)

    def save_checkpoint(
        self, completed_steps: int, write_payload: Callable[[Path], None], state: dict[str, Any], *, final: bool = False
    ) -> Checkpoint:
        """Write final/ or checkpoints/step_N atomically (see `Checkpoint.write`)."""
        target = self.final_dir if final else self.checkpoint_dir(completed_steps)
        return Checkpoint.write(target, write_payload, state)

    # ---- readers and writers -----------------------------------------------------------------
    def read_status(self) -> dict[str, Any]:
        """The trainer's status; {} before it first wrote one."""
        return read_json(self.status_file) or {}

    def write_status(self, status: dict[str, Any]) -> None:
        """status.json, its strings masked (retrain.housekeeping.secrets): an error may quote a url with its credentials."""
        from retrain.housekeeping.secrets import masked_values

        write_json_atomic(self.status_file, masked_values(status))

    def record_failure(self, error: str) -> None:
        """Mark the run failed in status.json before the trainer could (its checkpoints cannot be restored),
        keeping what the last attempt recorded there."""
        self.write_status(
            {
                **self.read_status(),
                "state": "failed",
                "error": error,
                "updated_at": time.time(),
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
            }
        )

    def read_job(self) -> dict[str, Any]:
        """What the campaign callback recorded when this attempt started; {} outside a campaign."""
        return read_json(self.job_file) or {}

    def read_exit(self) -> dict[str, Any] | None:
        """How the last attempt returned (Hydra's job status); None while it has not returned."""
        return read_json(self.exit_file)

    def read_hydra_config(self) -> dict[str, Any]:
        """The config Hydra composed for this run; {} when absent or unreadable."""
        try:
            return yaml.safe_load(read_text_file(self.hydra_config)) or {}
        except (FileNotFoundError, yaml.YAMLError):
            return {}

    def metrics_records(self) -> list[dict[str, Any]]:
        """Per-step records; a line still being written (the trainer appends while we read) is skipped."""
        if not self.metrics.is_file():
            return []
        records = []
        for line in self.metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records
