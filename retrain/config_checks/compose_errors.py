"""A mistake Hydra finds while composing the config, as the one line retrain prints for any mistake.

Hydra reports these over several lines, ending with advice about HYDRA_FULL_ERROR. For a mistyped key
it advises `+key=value`, which only moves the typo on to retrain's own check. Here each kind reads as
one line naming the override, with the key or option a typo most likely meant.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    SearchPathException,
)
from omegaconf import DictConfig
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
)

from retrain.errors import UserError

COMPOSE_ERRORS = (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    SearchPathException,
    InterpolationResolutionError,  # only in the `hydra` node (its run dir); retrain checks the rest itself
)
MERGING = re.compile(r"Error merging override (?P<override>.+)")
IN_FILE = re.compile(r"In '(?P<path>[^']+)': \w+ raised while composing config")
SCHEMA_PREFIX = "base_"  # a group's schemas (retrain/config.py registers them): not options to pick
LISTED_OPTIONS = 12  # more than this, and only the closest is named (--help lists them all)
# keys retrain no longer has -> what replaced them: a value for the old key seldom means the same under the new
REPLACED_KEYS = {
    "backend.micro_batch_size": "backend.micro_batch_tokens, which counts padded tokens (prompt + completion) per "
    "forward/backward, not rows (0 = all rows at once, as before)",
}


def compose_error_line(error: BaseException) -> str | None:
    """The one-line message for a compose-time mistake, or None when `error` is not one."""
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override {error.override!r}: {_joined(error.message)}{_quoting_hint(error.override)}"
    if isinstance(error, MissingConfigException):
        return _missing_option(error)
    if isinstance(error, SearchPathException):  # `--config-dir` names no directory
        return _joined(str(error))
    if isinstance(error, InterpolationResolutionError):
        return unresolvable(error) if str(error.full_key).startswith("hydra.") else None
    if not isinstance(error, ConfigCompositionException):
        return None
    cause = error.__cause__ or error.__context__  # Hydra raises a config file's error without `from`
    if not isinstance(cause, OmegaConfBaseException):
        return _joined(str(error))
    in_file = IN_FILE.match(str(error))
    where = f"{in_file['path']}: " if in_file else ""  # a config file (a preset) set it, not an override
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and isinstance(cause.parent_node, DictConfig):
        return where + _unknown_key(cause)
    merging = MERGING.match(str(error))
    if merging is not None:
        return f"{merging['override']}: {_first_line(str(cause))}"
    return f"{where}{cause.full_key}: {_first_line(str(cause))}" if cause.full_key else _joined(str(error))


def _quoting_hint(override: str) -> str:
    """How to pass a text with braces (a prompt template): the shell removes one pair of quotes, so Hydra needs its own."""
    key, equals, value = override.partition("=")
    if not equals or "{" not in value or value[:1] in "'\"[":
        return ""
    return f"; quote the value for Hydra inside the shell's quotes: \"{key}='{value}'\""


def unresolvable(error: InterpolationResolutionError) -> str:
    """`${oc.env:TOKEN}` with TOKEN unset, `${nosuch}`: the key whose interpolation cannot resolve, and why."""
    # "KeyError raised while resolving interpolation: "Environment variable 'TOKEN' not found"\n    full_key: ..."
    reason = str(error.msg or error).splitlines()[0].split("resolving interpolation: ", 1)[-1].strip('"')
    return f"{error.full_key}: its interpolation cannot be resolved: {reason}"


def output_dir_unwritable(key: str, error: OSError) -> str:
    """A run's or a sweep's directory that cannot be created or written (a file in its way, no
    permission, a full disk), named with the key that sets it."""
    where = f": {error.filename!r}" if error.filename else ""
    return f"cannot write the output dir ({key}): {error.strerror or error}{where}"


def config_mistake(error: Exception) -> str | None:
    """What a command that composes a config says of `error`: a ConfigError's message, or Hydra's or
    OmegaConf's refusal of an override as one line; None for anything else (a bug, kept as raised)."""
    if isinstance(error, (UserError, ValueError)) or type(error).__module__.split(".")[0] in ("hydra", "omegaconf"):
        return compose_error_line(error) or str(error)
    return None


def _unknown_key(cause: ConfigKeyError | ConfigAttributeError) -> str:
    known = [str(key) for key in cause.parent_node if not str(key).startswith("_") and key != "hydra"]
    # no schema: a plugin's arguments, which may grow
    return unknown_key_line(str(cause.full_key), known, grows=not dataclasses.is_dataclass(cause.object_type))


def unknown_key_line(full_key: str, known: Iterable[str], grows: bool = False) -> str:
    """`full_key` is no key of its section: the key it was replaced by, or the known key it most likely meant, and
    the known keys. One wording for a typo Hydra refuses and one a `+key=value` slipped past it
    (retrain.config.check_known_keys). `grows`: the section takes new keys (`+key=...` adds one)."""
    if full_key in REPLACED_KEYS:
        return f"config key {full_key!r} was replaced by {REPLACED_KEYS[full_key]}"
    known = sorted(known)
    parent, _, key = full_key.rpartition(".")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {f'{parent}.{close[0]}' if parent else close[0]!r}?" if close else ""
    if grows:
        hint += f"; a new argument is added with +{full_key}=..."
    return f"unknown config key {full_key!r}{hint}" + (f" (known: {', '.join(known)})" if known else "")


def _missing_option(error: MissingConfigException) -> str:
    if not error.options or not error.missing_cfg_file:
        return _first_line(str(error))
    group, _, option = error.missing_cfg_file.rpartition("/")
    options = [name for name in error.options if not name.startswith(SCHEMA_PREFIX)]
    close = difflib.get_close_matches(option, options, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    if close and len(options) > LISTED_OPTIONS:
        return f"{group}={option}: no such option{hint} (`python -m retrain --help` lists all {len(options)})"
    return f"{group}={option}: no such option{hint} (options: {', '.join(options)})"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else text


def _joined(text: str) -> str:
    """Hydra's lines joined, without the ones that only point (a caret under the input)."""
    return "; ".join(line.strip() for line in text.splitlines() if re.search(r"\w", line))
