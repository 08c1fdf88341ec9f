"""The real Trainer on backend=tinker (fake SDK at the import boundary, the tiny model's tokenizer):
steps train and bump the sampler's weights version, checkpoints hold the service's state path, a run
killed after a checkpoint resumes exactly, and the API key never reaches a file of the run dir."""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

from retrain.backend.tinker.backend import STATE_FILE
from retrain.config import compose
from retrain.run import build_trainer
from tests.backend.fake_tinker import FakeService
from tests.backend.tinker_helpers import FAKE_KEY, service
from tests.conftest import read_metrics, without_timing

__all__ = ["service"]  # fixture

STEPS = 3


def train(run_dir: Path, lock_dir: Path) -> dict:
    overrides = [
        "model=tiny",
        "data=arithmetic",
        "backend=tinker",
        f"backend.lock_dir={lock_dir}",
        "backend.retry_backoff_s=0",
        "reward._target_=tests.backend.tinker_rewards.odd_checksum_reward",
        "algorithm=grpo_none",
        "training.seed=0",  # not the default -1 (a seed per run): some seeds draw steps of uniform groups only
        "eval.num_examples=0",
        "scoring.workers=1",
        "logging.console_groups=0",
        "logging.progress_bar=false",
        "training.batch_size=2",
        "training.group_size=4",
        "training.max_tokens=6",
        "training.temperature=1.0",
        "training.top_p=1.0",
        "training.lr=0.05",
        "training.save_every=1",
        f"training.max_steps={STEPS}",
    ]
    with ExitStack() as parts:
        return build_trainer(compose(overrides), run_dir, parts).run()


def test_the_trainer_trains_checkpoints_and_resumes_exactly_on_tinker(service: FakeService, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert train(reference, tmp_path / "locks")["state"] == "done"
    records = read_metrics(reference)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["num_tokens"] > 0 for r in records)  # every step had signal and trained
    # every optimizer step published policy-v{N} and the sampler switched to it before the next step
    published = [r["name"] for r in service.requests["save_weights_for_sampler"]]
    assert published == [f"policy-v{version}" for version in range(STEPS + 1)]
    opened = [r["model_path"].rsplit("/", 1)[-1] for r in service.requests["create_sampling_client"]]
    assert opened == published
    state = json.loads((reference / "checkpoints" / "step_2" / STATE_FILE).read_text())
    assert state["tinker_path"] in service.storage and state["weights_version"] >= 1

    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    shutil.rmtree(killed / "final")
    shutil.rmtree(killed / "checkpoints" / f"step_{STEPS}")
    restores = len(service.requests["create_training_client_from_state_with_optimizer"])
    assert train(killed, tmp_path / "locks")["state"] == "done"
    assert len(service.requests["create_training_client_from_state_with_optimizer"]) == restores + 1
    assert without_timing(read_metrics(killed)) == without_timing(records)

    for run_dir in (reference, killed):
        for file in run_dir.rglob("*"):
            assert not file.is_file() or FAKE_KEY not in file.read_text(errors="ignore"), file
