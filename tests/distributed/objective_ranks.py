"""One training step of the local backend per objective setting, on the whole batch in one process and then on
this rank's share of it on a two-rank gloo group (`torchrun --nproc-per-node=2 tests/distributed/objective_ranks.py
OUT`); rank r writes OUT/rank<r>.json for tests/distributed/test_objective_ranks.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from retrain.backend.settings import LossSettings
from retrain.config import TrainingConfig
from retrain.distributed.world import join_world, leave_world
from retrain.model.spec import ModelSpec
from retrain.types import TrainBatch
from tests.backend.test_local_training import batch_for, sample
from tests.backend.tiny_model import make_backend

TINY = ModelSpec(name_or_path="retrain:tiny_qwen3", lora_rank=4)
SETTINGS = {
    "gspo-entropy": TrainingConfig(objective="gspo", entropy_coef=0.01),
    "cispo-seq_mean_token_sum": TrainingConfig(objective="cispo", loss_agg="seq_mean_token_sum"),
    "seq_sum_norm": TrainingConfig(loss_agg="seq_sum_norm", clip_eps=0.2),
}


def step(loss: LossSettings, batch: TrainBatch) -> dict:
    """The step's loss and the summed gradient the optimizer saw, from a fresh backend."""
    backend = make_backend(TINY, max_grad_norm=0.0, loss=loss)
    seen: list[float] = []
    backend.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.extend(torch.cat([p.grad.flatten() for p in backend.trainable]).tolist())
    )
    result = backend.train(batch)
    return {"loss": result.loss, "gradient": seen}


def main(out: Path) -> None:
    batch = batch_for(sample(make_backend(TINY)))
    whole = {name: step(LossSettings.from_config(training), batch) for name, training in SETTINGS.items()}
    world = join_world("cpu")
    first, stop = world.share(batch.rollouts.num_rows // batch.rollouts.group_size)
    groups = torch.arange(batch.rollouts.num_rows) // batch.rollouts.group_size
    mine = (groups >= first) & (groups < stop)
    share = TrainBatch(batch.rollouts, batch.advantages, batch.row_mask & mine)  # this rank trains its rows
    ranks = {name: step(LossSettings.from_config(training), share) for name, training in SETTINGS.items()}
    (out / f"rank{world.rank}.json").write_text(json.dumps({"one": whole, "two": ranks}))
    leave_world()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
