"""Pull the final answer out of a completion: the content of its last `\\boxed{...}`."""

from __future__ import annotations

import re

# `\boxed{` or `\fbox{` (whitespace allowed before the brace); not `\boxedx{`.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}` in `text`, or None when there is none.

    "Last" is by where the box opens, so in `\\boxed{\\fbox{5}}` it is the inner `5`. Braces nest
    (`\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`); a box that never closes, as in a completion cut
    off by max_tokens, yields the rest of the string.
    """
    openings = list(_BOX_OPEN.finditer(text))
    if not openings:
        return None
    opening = openings[-1]
    start = opening.end()
    depth = 1
    for position in range(start, len(text)):
        char = text[position]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:position]
    return text[start:]
