"""retrain installs as a wheel into a fresh virtual environment, conf/ and the tiny model inside it."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_built_wheel_runs_in_a_fresh_virtualenv(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(REPO)],
                   check=True, capture_output=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("retrain-*.whl"))
    # dependencies come from this interpreter's site-packages; retrain itself only from the wheel
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()

    where = subprocess.run([str(python), "-c", "import retrain, retrain.config as c; print(retrain.__file__); print(c.config_dir())"],
                           check=True, capture_output=True, text=True, cwd=workdir, env=env).stdout.split()
    assert str(tmp_path / "venv") in where[0] and str(tmp_path / "venv") in where[1], where

    run_dir = workdir / "run"
    demo = subprocess.run([str(tmp_path / "venv" / "bin" / "retrain"), "experiment=quickstart", "training.max_steps=2",
                           "eval.num_examples=0", "logging.progress_bar=false", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, cwd=workdir, env=env)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert (run_dir / "final" / "adapter_model.safetensors").is_file()
    module = subprocess.run([str(python), "-m", "retrain", "--cfg", "job", "experiment=quickstart"],
                            capture_output=True, text=True, cwd=workdir, env=env)
    assert module.returncode == 0 and "ArithmeticData" in module.stdout
