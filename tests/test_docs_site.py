"""The docs site (mkdocs.yml over docs/): every topic, config group, config key and command documented,
the generated CLI reference current, every relative link resolving, and `mkdocs build --strict` clean."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from retrain.cli import SUBCOMMANDS
from retrain.config import config_groups
from tests.conftest import REPO

DOCS = REPO / "docs"
GENERATED = {"cli.md"}  # names every command and option by construction: it proves nothing here
# the documentation topics a user looks for (and the two reference pages) -> the page that covers each
TOPICS = {
    "getting started": "getting-started.md",
    "configuration": "configuration.md",
    "plugins": "plugins.md",
    "advantages": "advantages.md",
    "SEPA": "sepa.md",
    "rewards": "rewards.md",
    "inference engines": "inference-engines.md",
    "back-pressure": "backpressure.md",
    "campaigns": "campaigns.md",
    "squeeze": "squeeze.md",
    "backends": "backends.md",
    "logging & wandb": "logging.md",
    "research guide": "research-guide.md",
    "capacity planning": "capacity-planning.md",
    "SLURM": "slurm.md",
    "CLI reference": "cli.md",
    "default config": "default-config.md",
}
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)(?:#[^)\s]*)?\)")


def written_docs() -> str:
    """The text of every hand-written page."""
    return "\n".join(
        page.read_text(encoding="utf-8") for page in sorted(DOCS.glob("*.md")) if page.name not in GENERATED
    )


def nav_pages(nav: list[Any]) -> Iterator[str]:
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            if isinstance(value, list):
                yield from nav_pages(value)
            else:
                yield value


def config_keys(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted keys of the flattened default config a user sets (`_target_`-style internals and
    interpolations of another key left out)."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if key.startswith("_") or (isinstance(value, str) and value.startswith("${")):
            continue
        if isinstance(value, dict) and value:
            yield from config_keys(value, dotted + ".")
        else:
            yield dotted


def test_every_seed_topic_has_a_page_in_the_nav() -> None:
    nav = list(nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))
    missing = {topic: page for topic, page in TOPICS.items() if not (DOCS / page).is_file() or page not in nav}
    assert not missing, f"topics without a page in docs/ and in mkdocs.yml's nav: {missing}"
    unlisted = sorted({page.name for page in DOCS.glob("*.md")} - set(nav))
    assert not unlisted, f"docs pages missing from mkdocs.yml's nav: {unlisted}"


def test_every_config_group_and_option_is_documented() -> None:
    text = written_docs()
    undocumented = []
    for group, options in config_groups().items():
        if f"`{group}`" not in text and f"{group}=" not in text:
            undocumented.append(group)
        undocumented += [
            f"{group}={option}" for option in options if f"{group}={option}" not in text and f"`{option}`" not in text
        ]
    assert not undocumented, f"config groups or options no docs page names: {undocumented}"


def test_every_default_config_key_is_documented() -> None:
    text = written_docs()
    defaults = yaml.safe_load((DOCS / "default-config.yaml").read_text())
    undocumented = [key for key in config_keys(defaults) if key not in text]
    assert not undocumented, f"config keys no docs page names (docs/configuration.md lists them): {undocumented}"


def test_every_command_is_documented_beyond_its_help() -> None:
    text = written_docs()
    commands = [f"retrain {name}" for name in SUBCOMMANDS]
    undocumented = [command for command in commands if not re.search(rf"{re.escape(command)}(?![\w-])", text)]
    assert "python -m retrain " in text, "the training entry `python -m retrain` is not documented"
    assert not undocumented, f"commands that only docs/cli.md names, no guide: {undocumented}"


def test_every_generated_block_of_the_manual_is_current() -> None:
    """`retrain man --check` as CI runs it: the CLI reference, the default config, the backends' tables."""
    result = subprocess.run(
        [sys.executable, "-m", "retrain", "man", "--check"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_relative_links_resolve() -> None:
    """README's links into docs/ and the pages' links to each other (mkdocs checks the latter too, when installed)."""
    broken = []
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="needs mkdocs-material (pip install -e '.[docs]')",
)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "site" / "cli" / "index.html").is_file()
