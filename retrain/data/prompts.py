"""Prompt templates with named `{placeholder}` slots that leave LaTeX braces alone.

`str.format` would demand `\\boxed{{}}` in every template and choke on `{x}` inside a problem;
here only the declared names are substituted, in one pass, so a value that itself contains
`{reference}` is never substituted again.
"""

from __future__ import annotations

import re

from retrain.errors import ConfigError

DEFAULT_PROMPT_TEMPLATE = "{question}\n\nSolve the problem step by step. Put your final answer in \\boxed{}."


def check_template(template: str, required: set[str], setting: str) -> None:
    """ConfigError naming `setting` unless every required `{name}` slot appears in `template`."""
    missing = sorted(name for name in required if "{" + name + "}" not in template)
    if missing:
        slots = ", ".join("{" + name + "}" for name in missing)
        raise ConfigError(f"{setting} must contain {slots}; got {template!r}")


def fill_template(template: str, **values: str) -> str:
    """`template` with each `{name}` of `values` replaced by its value; other braces untouched."""
    if not values:
        return template
    pattern = re.compile(r"\{(" + "|".join(re.escape(name) for name in values) + r")\}")
    return pattern.sub(lambda match: values[match.group(1)], template)


def template_line(template: str) -> str:
    """The run log's line naming the prompt template in use: the default asks for a `\\boxed{}` answer,
    which a model not trained to box answers may never give (reward=match then scores every completion 0)."""
    if template == DEFAULT_PROMPT_TEMPLATE:
        return f"Prompt template (data.prompt_template, the default, asks for \\boxed{{}}): {template!r}"
    return f"Prompt template (data.prompt_template): {template!r}"
