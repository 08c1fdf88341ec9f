"""Text that `str.isdigit` calls digits but `int` refuses (`²`) is no number anywhere retrain reads one."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.backend.devices import resolve_device
from retrain.errors import ConfigError
from retrain.housekeeping.digits import whole_number
from retrain.housekeeping.rundir import RunDir
from retrain.model import device_memory


@pytest.mark.parametrize("text", ["²", "٣", "1²", "", "-1", "1.5"])
def test_only_ascii_digits_make_a_whole_number(text: str) -> None:
    assert whole_number(text) is None


def test_a_device_index_in_unicode_digits_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"backend\.devices='gpu:²' is not 'cpu' or 'gpu:N'"):
        resolve_device("gpu:²")


def test_a_step_dir_numbered_in_unicode_digits_is_no_checkpoint(tmp_path: Path) -> None:
    for name in ("step_²", "step_3"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert [p.name for p in RunDir(tmp_path).step_dirs()] == ["step_3"]


def test_a_cgroup_limit_in_unicode_digits_reads_as_no_limit(tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("²\n")
    assert device_memory._read_int(limit) is None
    limit.write_text("4096\n")
    assert device_memory._read_int(limit) == 4096
