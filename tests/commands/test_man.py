"""`retrain man`: the bundled docs pages by topic, with close matches for a typo."""

from __future__ import annotations

import json

import pytest

from retrain.commands.man import main, manual_dir, pages
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
