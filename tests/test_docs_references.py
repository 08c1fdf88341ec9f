"""Comments and messages under retrain/ and conf/ name documents a reader has: docs/ pages that exist,
never sections of the design spec ("SPEC §6") or the product notes retrain was grown from ("the seeds")."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

SOURCES = (REPO / "retrain", REPO / "conf")
SKIPPED = (REPO / "retrain" / "assets",)  # model and tokenizer files: vocabulary, not prose
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".md", ".txt", ".toml", ".cfg", ".ini"}
DOCS_PAGE = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)\b")

# Citations of documents that ship with neither the package nor the repository. The original TOML
# format is a product concept (docs/migrate-config.md) and is named as "the original TOML format".
UNAVAILABLE = {
    "a SPEC section": re.compile(r"\bSPEC\b|§\s*\d"),
    "the design notes": re.compile(r"SPEC-algorithms|DESIGN\.md|shared/seeds"),
    "the seeds as a document": re.compile(
        r"\b[Ss]eeds'|\bseeds-style\b|\bseed 00\d\b|\b(?:as in|as|per|like|see) the seeds\b"
        r"|\bthe seeds (?:did|do|say|says|name|named)\b|\bthe seeds:"
    ),
}


def source_files() -> Iterator[Path]:
    for root in SOURCES:
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and not any(path.is_relative_to(s) for s in SKIPPED):
                yield path


def citations(text: str) -> list[str]:
    """What `text` cites that a reader of the repository does not have, as `kind: match`."""
    return [f"{kind}: {found.group(0)!r}" for kind, pattern in UNAVAILABLE.items() for found in pattern.finditer(text)]


@pytest.mark.parametrize(
    "text",
    [
        "adapts the batch size to throughput (SPEC §9).",
        "AdamW knobs (§6)",
        "# the seeds' `.env` in the working directory",
        "a seeds-style TOML config becomes a Hydra preset",
        "Fixtures: mini.toml (seed 004)",
        "ignored when [environment] is set (as in the seeds)",
        "names wandb runs as the seeds did",
        "see /work/shared/SPEC-algorithms.md",
    ],
)
def test_the_detector_finds_each_kind_of_unavailable_citation(text: str) -> None:
    assert citations(text), text


@pytest.mark.parametrize(
    "text",
    [
        "Mean and std over the seeds that reached each step.",
        "training.seed=1,2 replaces the seeds below",
        "a campaign of conditions x seeds",
        "the original TOML format's [training] and [optimizer] (docs/migrate-config.md)",
        "spec = importlib.util.find_spec('retrain.conf')",
        "from retrain.migrate.seeds import DEFAULT_SEEDS",
        "tests/inference/vllm_helpers.py: SPEC_FILE",
    ],
)
def test_random_seeds_and_code_names_are_not_citations(text: str) -> None:
    assert not citations(text), text


def test_sources_cite_no_document_a_reader_lacks() -> None:
    found = [
        f"{path.relative_to(REPO)}:{number}: {hit}"
        for path in source_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for hit in citations(line)
    ]
    assert not found, "cite a docs/ page or say it in place instead:\n" + "\n".join(found)


def test_every_docs_page_the_sources_name_exists() -> None:
    named = {
        (path.relative_to(REPO), page)
        for path in source_files()
        for page in DOCS_PAGE.findall(path.read_text(encoding="utf-8"))
    }
    assert named, "no docs/ page named under retrain/ or conf/: the pattern is broken"
    missing = sorted(f"{path}: docs/{page}" for path, page in named if not (REPO / "docs" / page).is_file())
    assert not missing, f"docs/ pages named in the sources that do not exist: {missing}"
