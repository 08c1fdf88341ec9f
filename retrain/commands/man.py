"""`retrain man [--topic T] [--list-topics] [--json] [--path] [--check | --sync]`: the bundled manual in the terminal.

The manual is docs/*.md, shipped inside the wheel as `retrain.manual` (setup.py), so an installed
retrain reads the pages of its own version; a topic is a page's file stem (`retrain man --topic sepa`).
`--check` exits 1 naming each machine-written block (retrain/commands/man_blocks.py) that is stale, and
`--sync` rewrites them.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import pydoc
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Page:
    """One manual page: its topic (the file stem), its first heading and where it lives."""

    topic: str
    title: str
    path: Path

    def as_dict(self) -> dict[str, str]:
        return {"topic": self.topic, "title": self.title, "path": str(self.path)}


def manual_dir() -> Path:
    """docs/ as `retrain.manual` inside an installed wheel, through an editable install, or in a checkout."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "manual"
    if packaged.is_dir():
        return packaged
    spec = importlib.util.find_spec("retrain.manual")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return package.parent / "docs"


def pages(root: Path | None = None) -> dict[str, Page]:
    """Every page of the manual by topic, sorted."""
    root = manual_dir() if root is None else root
    return {path.stem: Page(path.stem, _title(path), path) for path in sorted(root.glob("*.md"))}


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="retrain man", description=__doc__.splitlines()[0])
    parser.add_argument("--topic", "-t", help="the page to show (a file stem of docs/, e.g. getting-started)")
    parser.add_argument("--list-topics", action="store_true", help="print the topics, one a line")
    parser.add_argument("--json", action="store_true", help="machine-readable output (the page's text with --topic)")
    parser.add_argument("--path", action="store_true", help="print where the manual's pages are (or the topic's page)")
    generated = parser.add_mutually_exclusive_group()
    generated.add_argument(
        "--check", action="store_true", help="exit 1 naming each generated block of the manual that is stale (for CI)"
    )
    generated.add_argument(
        "--sync", action="store_true", help="rewrite the generated blocks of the manual that are stale"
    )
    args = parser.parse_args(argv)
    manual = pages()
    if not manual:
        parser.exit(1, f"retrain man: no manual pages found in {manual_dir()}\n")
    if args.check or args.sync:
        return _check_or_sync(parser, sync=args.sync, as_json=args.json)
    if args.topic is not None:
        return _show_topic(parser, manual, args.topic, as_json=args.json, path_only=args.path)
    if args.path:
        print(manual_dir())
    elif args.json:
        print(json.dumps({"manual_dir": str(manual_dir()), "topics": [p.as_dict() for p in manual.values()]}, indent=2))
    elif args.list_topics:
        print("\n".join(manual))
    else:
        width = max(map(len, manual))
        print("retrain manual: retrain man --topic <topic>\n")
        print("\n".join(f"  {p.topic:<{width}}  {p.title}" for p in manual.values()))
    return 0


def _show_topic(
    parser: argparse.ArgumentParser, manual: dict[str, Page], topic: str, *, as_json: bool, path_only: bool
) -> int:
    page = manual.get(topic.removesuffix(".md"))
    if page is None:
        close = difflib.get_close_matches(topic, list(manual), n=3, cutoff=0.5)
        hint = f"did you mean: {', '.join(close)}?" if close else f"topics: {', '.join(manual)}"
        parser.exit(1, f"retrain man: no topic {topic!r}; {hint}\n")
    if path_only:
        print(page.path)
    elif as_json:
        print(json.dumps({**page.as_dict(), "text": page.path.read_text(encoding="utf-8")}, indent=2))
    elif sys.stdout.isatty():
        pydoc.pager(page.path.read_text(encoding="utf-8"))
    else:
        sys.stdout.write(page.path.read_text(encoding="utf-8"))
    return 0


def _check_or_sync(parser: argparse.ArgumentParser, *, sync: bool, as_json: bool) -> int:
    from retrain.commands.man_blocks import ManualError, stale_blocks, sync_blocks

    root = manual_dir()
    try:
        blocks = sync_blocks(root) if sync else stale_blocks(root)
    except ManualError as error:
        parser.exit(1, f"retrain man: {error}\n")
    named = [{"name": block.name, "path": str(root / block.page)} for block in blocks]
    if as_json:
        print(json.dumps({"manual_dir": str(root), "synced" if sync else "stale": named}, indent=2))
    elif sync:
        print("\n".join(f"rewrote {b['name']} in {b['path']}" for b in named) or "every generated block is current")
    elif named:
        stale = ", ".join(f"{b['name']} ({b['path']})" for b in named)
        print(f"retrain man: stale generated blocks: {stale}; rewrite them with `retrain man --sync`", file=sys.stderr)
    return 1 if named and not sync else 0
