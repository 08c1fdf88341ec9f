"""retrain's collectives on a real two-rank gloo group started by torchrun (tests/distributed/ranks.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from retrain.distributed.world import World, rank_devices
from retrain.errors import ConfigError
from tests.conftest import REPO, checked, cli_env
from tests.distributed import TORCHRUN


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    command = [*TORCHRUN, "--nproc-per-node=2", str(REPO / "tests" / "distributed" / "ranks.py"), str(out)]
    checked(subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=300))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_shares_are_contiguous_and_cover_the_batch() -> None:
    shares = [World(rank, 3).share(8) for rank in range(3)]
    assert shares == [(0, 3), (3, 6), (6, 8)]


def test_each_rank_knows_its_share(ranks: list[dict]) -> None:
    assert [r["share"] for r in ranks] == [[0, 3], [3, 5]]


def test_gathered_rows_are_the_ranks_rows_in_rank_order_padded_on_their_side(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["right"] == [[0, 1, -1], [10, 11, 12], [13, 14, 15]]
        assert result["left"] == [[-1, 0, 1], [10, 11, 12], [13, 14, 15]]


def test_a_second_threads_collectives_on_their_own_group_never_pair_with_the_main_threads(ranks: list[dict]) -> None:
    for result in ranks:  # issued in opposite orders on the two ranks (ranks.py: crossed_collectives)
        assert result["crossed"] == {"gathered": [[0, 1, -1], [10, 11, 12], [13, 14, 15]], "summed": [3.0]}


def test_gradients_are_summed_over_ranks_a_missing_one_counting_zero(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["grads"] == [[[3.0, 3.0], [3.0, 3.0]], [1.0, 1.0, 1.0]]


def test_ranks_that_disagree_stop_with_the_ranks_named(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["same"] is None
        assert result["different"] == (
            "ranks [1] have another config than rank 0: every rank of a run must be launched with the same "
            "overrides and environment"
        )
        assert "adapter checksum after step 9" in result["diverged"]


def test_a_rank_uses_its_own_device_and_split_mode_is_refused() -> None:
    assert rank_devices("gpu:0,gpu:1", World(0, 1)) == "gpu:0,gpu:1"  # one process: as configured
    with pytest.raises(ConfigError, match="split mode runs on one process"):
        rank_devices("gpu:0,gpu:1", World(1, 2))
