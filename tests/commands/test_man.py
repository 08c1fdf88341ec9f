"""`retrain man`: the bundled docs pages by topic, with close matches for a typo."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from retrain.commands.man import main, manual_dir, pages
from retrain.commands.man_blocks import BLOCKS, ManualError, stale_blocks, sync_blocks
from tests.conftest import REPO


def test_topics_are_the_stems_of_the_docs_pages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-topics"]) == 0
    topics = capsys.readouterr().out.split()
    assert topics == sorted(path.stem for path in (REPO / "docs").glob("*.md"))
    assert {"getting-started", "plugins", "campaigns"} <= set(topics)


def test_a_topic_prints_its_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--topic", "plugins"]) == 0
    assert capsys.readouterr().out == (REPO / "docs" / "plugins.md").read_text(encoding="utf-8")


def test_json_carries_the_page_and_its_title(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--topic", "sepa", "--json"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert page["topic"] == "sepa" and page["title"] == "SEPA" and page["text"].startswith("# SEPA")
    assert main(["--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {"topic": "sepa", "title": "SEPA", "path": str(pages()["sepa"].path)} in listing["topics"]


def test_path_is_the_manual_dir_or_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--path"]) == 0
    assert capsys.readouterr().out.strip() == str(manual_dir()) == str((REPO / "docs").resolve())
    assert main(["--path", "--topic", "sepa"]) == 0
    assert capsys.readouterr().out.strip() == str(pages()["sepa"].path)


def test_an_unknown_topic_fails_naming_close_matches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--topic", "campains"])
    assert exit_info.value.code == 1
    assert "did you mean: campaigns" in capsys.readouterr().err


def test_no_arguments_lists_topics_with_titles(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "getting-started" in out and "Getting started" in out


CHEAP = [block for block in BLOCKS if block.name in ("default-config", "backend-options")]  # rendered in < 1 s


def manual_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "docs"
    shutil.copytree(REPO / "docs", copy)
    return copy


def test_check_names_each_stale_block_and_sync_rewrites_only_those(tmp_path: Path) -> None:
    docs = manual_copy(tmp_path)
    assert stale_blocks(docs, CHEAP) == []
    backends = (docs / "backends.md").read_text(encoding="utf-8")
    changed = backends.replace("| `backend.zmq_port` | int | `5555` |", "| `backend.zmq_port` | int | `5556` |")
    assert changed != backends
    (docs / "backends.md").write_text(changed, encoding="utf-8")
    (docs / "default-config.yaml").unlink()  # a generated page that is missing is stale too
    assert [block.name for block in stale_blocks(docs, CHEAP)] == ["default-config", "backend-options"]
    assert [block.name for block in sync_blocks(docs, CHEAP)] == ["default-config", "backend-options"]
    assert (docs / "backends.md").read_text(encoding="utf-8") == backends  # the hand-written text kept
    assert (docs / "default-config.yaml").read_text() == (REPO / "docs" / "default-config.yaml").read_text()
    assert stale_blocks(docs, CHEAP) == [] and sync_blocks(docs, CHEAP) == []


def test_a_page_without_its_markers_is_named(tmp_path: Path) -> None:
    docs = manual_copy(tmp_path)
    text = (docs / "backends.md").read_text(encoding="utf-8")
    (docs / "backends.md").write_text(text.replace("<!-- end generated: backend-options -->", ""), encoding="utf-8")
    with pytest.raises(ManualError, match="the markers of the generated block 'backend-options' are missing"):
        stale_blocks(docs, CHEAP)


@pytest.mark.slow
def test_man_check_and_sync_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = manual_copy(tmp_path)
    monkeypatch.setattr("retrain.commands.man.manual_dir", lambda: docs)  # the pages a wheel or checkout would hold
    cli_page = (docs / "cli.md").read_text(encoding="utf-8")
    (docs / "cli.md").write_text(cli_page.replace("--list-topics", "--list-topix"), encoding="utf-8")
    assert main(["--check"]) == 1
    assert f"stale generated blocks: cli-reference ({docs / 'cli.md'}); rewrite them" in capsys.readouterr().err
    assert main(["--check", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["stale"] == [{"name": "cli-reference", "path": str(docs / "cli.md")}]
    assert main(["--sync"]) == 0
    assert capsys.readouterr().out == f"rewrote cli-reference in {docs / 'cli.md'}\n"
    assert (docs / "cli.md").read_text(encoding="utf-8") == cli_page
    assert main(["--check"]) == 0
