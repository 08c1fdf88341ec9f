"""Where a step's metrics go: jsonl files in the run dir, the console line, and wandb."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any


class JsonlLog:
    """An append-only jsonl file of per-step records that can be rewound to a checkpoint's step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record, default=_json_default) + "\n")

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def restore_from(self, source: Path, last_step: int) -> None:
        """Keep the records of steps <= last_step from `source` (this file or another run's)."""
        kept = [r for r in JsonlLog(source).records() if r.get("step", -1) <= last_step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as handle:
            handle.writelines(json.dumps(r, default=_json_default) + "\n" for r in kept)
        shutil.move(tmp, self.path)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {value!r}")


def console_line(record: dict[str, Any], label: str, placeholder_loss: bool) -> str:
    """The seeds' per-step line: `Step 0 [maxrl+gtpo_sepa] | loss=... | reward=... | ...`."""
    loss = f"{record['loss']:.4f}" + (" (placeholder)" if placeholder_loss else "")
    return (
        f"Step {record['step']} [{label}] | loss={loss} | reward={record['mean_reward']:.3f}"
        f" | correct={100 * record['correct_rate']:.1f}% | datums={record['num_datums']}"
        f" | bs={record['batch_size']} | gs={record['group_size']}"
        f" | sepa_l={record.get('sepa_lambda', 0.0):.4f} | time={record['step_time_s']:.2f}s"
    )


def wandb_key(key: str) -> str:
    """Seeds' prefixes: everything under `train/` (`train/entropy/...`, `train/reward/errors`, ...)."""
    return key if key.startswith(("train/", "eval/")) else f"train/{key}"


class WandbSink:
    """Logs each step to wandb under the seeds' `train/` prefixes; resumes the same wandb run."""

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

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, record: dict[str, Any], step: int) -> None:
        numeric = {
            wandb_key(k): v
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        numeric.update({wandb_key(k): int(v) for k, v in record.items() if isinstance(v, bool)})
        self.run.log(numeric, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def finish(self) -> None:
        self.run.finish()
