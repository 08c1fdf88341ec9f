"""Where a step's metrics go: jsonl files in the run dir, the console line, and wandb."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from retrain.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

NONFINITE_KEYS = "nonfinite_keys"  # a record's keys whose value was NaN or ±inf, written as null


class JsonlLog:
    """An append-only jsonl file of per-step records that can be rewound to a checkpoint's step.

    Strict JSON, one record a line: a non-finite number is written as null and its key listed under
    `nonfinite_keys`. A line goes in whole or not at all (one write, truncated back if the disk refuses
    part of it); a kill of the machine mid-write can still leave a torn last line, which reading drops.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        line = (_json_line(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            end = os.fstat(fd).st_size
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes", str(self.path))
            except BaseException:
                os.ftruncate(fd, end)  # no torn line left behind
                raise
        finally:
            os.close(fd)

    def records(self) -> list[dict[str, Any]]:
        """Every record; a torn last line (a kill or a full disk mid-write) is dropped with a warning, any other
        line that does not parse is a CheckpointError naming it (a restore cannot tell which step it held)."""
        if not self.path.exists():
            return []
        lines = self.path.read_bytes().split(b"\n")
        records = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as error:  # JSON or UTF-8 that does not decode
                if number == len(lines):  # no newline after it: the write was cut
                    log.warning("dropping the torn last line of %s (%d bytes)", self.path, len(line))
                    continue
                raise CheckpointError(
                    f"{self.path} line {number} is not a JSON record ({error}); remove or repair that line"
                ) from error
        return records

    def restore_from(self, source: Path, last_step: int) -> None:
        """Keep the records of steps <= last_step from `source` (this file or another run's)."""
        kept = [r for r in JsonlLog(source).records() if r.get("step", -1) <= last_step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as handle:
            handle.writelines(_json_line(r) + "\n" for r in kept)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)

    def clear(self) -> bool:
        """Empty the file (a run starting over from step 0); whether it held anything."""
        held = self.path.is_file() and self.path.stat().st_size > 0
        with open(self.path, "wb"):
            pass
        return held


def _json_line(record: dict[str, Any]) -> str:
    """`record` as strict JSON on one line: non-finite numbers become null, their keys listed (NONFINITE_KEYS)."""
    nonfinite: list[str] = []
    finite = _finite(record, "", nonfinite)
    if nonfinite:
        finite[NONFINITE_KEYS] = nonfinite
    return json.dumps(finite, allow_nan=False)


def _finite(value: Any, key: str, nonfinite: list[str]) -> Any:
    """`value` with tensors and numpy numbers as Python numbers and NaN/±inf as None (their keys into `nonfinite`)."""
    if isinstance(value, dict):
        return {k: _finite(v, f"{key}.{k}" if key else str(k), nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v, f"{key}[{i}]", nonfinite) for i, v in enumerate(value)]
    if not isinstance(value, (str, int, float)) and hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(key)
        return None
    return value


def console_line(record: dict[str, Any], label: str, placeholder_loss: bool) -> str:
    """The original retrain's per-step line: `Step 0 [maxrl+gtpo_sepa] | loss=... | reward=... | ...`, with the KL to
    the base model after the loss when the loss has one (training.kl_coef > 0)."""
    loss = f"{record['loss']:.4f}" + (" (placeholder)" if placeholder_loss else "")
    kl = record.get("policy/kl")
    return (
        f"Step {record['step']} [{label}] | loss={loss}"
        + (f" | kl={kl:.4g}" if isinstance(kl, (int, float)) else "")
        + f" | reward={record['mean_reward']:.3f}"
        f" | correct={100 * record['correct_rate']:.1f}% | datums={record['num_datums']}"
        f" | bs={record['batch_size']} | gs={record['group_size']}"
        f" | sepa_l={record.get('sepa_lambda', 0.0):.4f} | time={record['step_time_s']:.2f}s"
    )


def wandb_key(key: str) -> str:
    """The original retrain's prefixes: everything under `train/` (`train/entropy/...`, `train/reward/errors`, ...)."""
    return key if key.startswith(("train/", "eval/")) else f"train/{key}"


def logged_scalars(record: dict[str, Any]) -> dict[str, float | int]:
    """A step record's numbers under wandb's keys (`wandb_key`), as wandb and TensorBoard log them: finite
    numbers as they are, booleans as 0/1, everything else (names, nulls, NaN) left out."""
    numeric: dict[str, float | int] = {
        wandb_key(k): v
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    numeric.update({wandb_key(k): int(v) for k, v in record.items() if isinstance(v, bool)})
    return numeric


def check_wandb_login(project: str) -> None:
    """A run that logs to wandb learns before its data and model load that wandb has no usable API key;
    `wandb.init` would say so only once the model has loaded. wandb's own login looks (the environment,
    ~/.netrc, a prompt on a terminal) without asking the server; offline and disabled runs need no key."""
    if not project:
        return
    import wandb

    if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):
        return
    try:
        wandb.login(verify=False)
    except (wandb.errors.Error, ValueError) as error:  # ValueError: a malformed key, in older wandb
        raise wandb_cannot_start(project, error) from error


def wandb_cannot_start(project: str, error: Exception) -> ConfigError:
    return ConfigError(
        f"logging.wandb_project={project!r}: wandb cannot start: {error} (or log offline: WANDB_MODE=offline)"
    )


class WandbSink:
    """Logs each step to wandb under the original retrain's `train/` prefixes; resumes the same wandb run."""

    def __init__(
        self,
        *,
        project: str,
        entity: str,
        group: str,
        name: str,
        tags: list[str],
        config: dict[str, Any],
        run_dir: Path,
        run_id: str | None,
    ) -> None:
        import wandb

        self._wandb = wandb
        try:
            self.run = wandb.init(
                project=project,
                entity=entity or None,
                group=group or None,
                name=name or None,
                tags=tags or None,
                config=config,
                dir=str(run_dir),
                id=run_id,
                resume="allow",
            )
        except (wandb.errors.Error, ValueError) as error:  # no or a wrong key, a malformed name, no server
            raise wandb_cannot_start(project, error) from error

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, record: dict[str, Any], step: int) -> None:
        self.run.log(logged_scalars(record), step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def finish(self) -> None:
        self.run.finish()


TENSORBOARD_DIR = "tensorboard"  # inside the run dir


def check_tensorboard(enabled: bool) -> None:
    """`logging.tensorboard=true` without the tensorboard package: said before the data and model load."""
    if not enabled:
        return
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError as error:
        raise ConfigError(
            "logging.tensorboard=true needs the tensorboard package: pip install 'retrain[tensorboard]'"
        ) from error


class TensorBoardSink:
    """Each step's numbers as TensorBoard scalars, under the keys wandb gets (`logged_scalars`), in
    <run dir>/tensorboard. A resumed run first drops what the files hold from its first step on, so no
    step shows twice (the steps after the checkpoint are logged again)."""

    def __init__(self, run_dir: Path, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=first_step or None)

    def log(self, record: dict[str, Any], step: int) -> None:
        for key, value in logged_scalars(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # a live run is followed in TensorBoard as it trains

    def close(self) -> None:
        self.writer.close()
