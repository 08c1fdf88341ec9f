"""Whole numbers read from text a person, a shell or a file wrote: ASCII digits only.

`str.isdigit` also accepts `²`, `٣` and other Unicode digits that `int` then refuses (or reads as another
number), so a check with it lets a ValueError through where a clear message belongs.
"""

from __future__ import annotations


def whole_number(text: str) -> int | None:
    """`text`, spaces around it aside, as a whole number >= 0; None unless it is ASCII digits 0-9 only."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() else None
