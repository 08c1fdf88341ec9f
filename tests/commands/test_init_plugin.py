"""`retrain init-plugin`: each kind's scaffold passes its own generated tests, and a run composes with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from retrain.commands.init_plugin import KINDS, main
from tests.conftest import cli_env, run_cli

NAMES = {
    "advantage": "my_adv",
    "transform": "my_clip",
    "uncertainty": "my_unc",
    "reward": "my_rew",
    "backend": "my_back",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind scaffolded into one project, with tests."""
    root = tmp_path_factory.mktemp("project")
    for kind, name in NAMES.items():
        assert main(["--kind", kind, "--name", name, "--with-test", "--dir", str(root)]) == 0
    return root


def test_files_of_each_kind(project: Path) -> None:
    for kind, name in NAMES.items():
        assert (project / f"{name}.py").is_file() and (project / f"test_{name}.py").is_file()
        assert (project / "conf" / KINDS[kind].group / f"{name}.yaml").is_file()


@pytest.mark.parametrize(
    "kinds",
    [
        pytest.param(["advantage", "transform", "uncertainty", "reward"], id="algorithm-and-reward"),
        pytest.param(["backend"], id="backend", marks=pytest.mark.slow),  # loads the tiny model and trains a step
    ],
)
def test_generated_tests_pass_as_written(project: Path, kinds: list[str]) -> None:
    tests = [f"test_{NAMES[kind]}.py" for kind in kinds]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=project,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert f"{2 * len(kinds)} passed" in result.stdout


@pytest.mark.parametrize(
    ("kind", "key", "expected"),
    [
        ("advantage", ("algorithm", "advantage", "_target_"), "my_adv.my_adv"),
        ("transform", ("algorithm", "transforms", "my_clip", "_target_"), "my_clip.MyClip"),
        ("uncertainty", ("algorithm", "uncertainty"), "my_unc.my_unc"),
        ("reward", ("reward", "_target_"), "my_rew.my_rew"),
        ("backend", ("backend", "_target_"), "my_back.MyBack"),
    ],
)
def test_the_printed_command_composes_a_run_with_it(
    project: Path, kind: str, key: tuple[str, ...], expected: str
) -> None:
    selection = KINDS[kind].override.format(name=NAMES[kind])
    node = yaml.safe_load(run_cli(["--config-dir", "conf", selection, "--cfg", "job"], cwd=project).stdout)
    for part in key:
        node = node[part]
    assert node == expected


def test_refuses_to_overwrite_and_bad_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kind", "reward", "--name", "scorer", "--dir", str(tmp_path)]) == 0
    (tmp_path / "scorer.py").write_text("# mine\n")
    with pytest.raises(SystemExit) as refused:
        main(["--kind", "reward", "--name", "scorer", "--dir", str(tmp_path)])
    assert refused.value.code == 1 and "--force" in capsys.readouterr().err
    assert (tmp_path / "scorer.py").read_text() == "# mine\n"
    with pytest.raises(SystemExit) as builtin:
        main(["--kind", "reward", "--name", "match", "--dir", str(tmp_path)])
    assert builtin.value.code == 1 and "reward=match is built in" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        main(["--kind", "reward", "--name", "my-reward", "--dir", str(tmp_path)])
    assert bad.value.code == 2 and "Python identifier" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "origin"),
    [
        ("retrain", "retrain/__init__.py"),
        ("torch", "torch/__init__.py"),
        ("os", "the standard library"),
        ("sys", "the standard library"),
        ("json", "the standard library"),
    ],
)
def test_a_name_that_shadows_a_module_a_run_imports_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, origin: str
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--kind", "reward", "--name", name, "--dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert refused.value.code == 1 and f"--name {name} would shadow the module {name} (" in error and origin in error
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_name_hydra_cannot_read_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--kind", "reward", "--name", "ｍｙ＿ｒｅｗａｒｄ", "--dir", str(tmp_path)])
    assert refused.value.code == 2 and "lower-case ASCII Python identifier" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
