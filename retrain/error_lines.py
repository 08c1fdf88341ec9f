"""What a person is told of an error: the user's mistake behind Hydra's wrapping, on one line.

The console (retrain.cli) prints it, and status.json records it (retrain.run), so both say the same.
"""

from __future__ import annotations

import re

from hydra.errors import InstantiationException

from retrain.errors import WRONG_ARGUMENTS, ConfigError, UserError

# Hydra's words when a `_target_` does not import: "Error locating target 'x', ...\nfull_key: reward"
UNLOCATABLE_TARGET = re.compile(
    r"Error locating target '(?P<target>[^']*)'.*?(?:\nfull_key: (?P<key>\S+))?\s*$", re.DOTALL
)
# ... and when calling it raised: "Error in call to target 'm.C':\nTypeError(...)\nfull_key: algorithm.transforms.c"
FAILED_CALL = re.compile(r"Error in call to target '(?P<target>[^']*)'.*?(?:\nfull_key: (?P<key>\S+))?\s*$", re.DOTALL)


def user_error_behind(error: BaseException | None) -> UserError | None:
    """The UserError an error is, or was raised from (Hydra wraps errors raised in instantiate)."""
    from retrain.plugins import PluginError, raised_in_plugin  # here: `retrain status` starts without torch

    while error is not None:
        if isinstance(error, UserError):
            return error
        plugin = raised_in_plugin(error)
        if plugin is not None:
            return PluginError(f"{plugin} raised {type(error).__name__}: {error}")
        mistake = _target_mistake(error)
        if mistake is not None:
            return mistake
        error = error.__cause__
    return None


def _target_mistake(error: BaseException) -> UserError | None:
    """A `_target_` that does not import (a typo, a module not on the path), or that does not take
    the arguments its config node gives (a `+key=value` typo), is a config mistake; a plugin's that
    raises as it is built is the plugin's."""
    if not isinstance(error, InstantiationException):
        return None
    from retrain.plugins import PluginError, import_failure  # here: `retrain status` starts without torch

    match = UNLOCATABLE_TARGET.match(str(error))
    if match is not None:
        key = f"{match['key']}._target_" if match["key"] else "_target_"
        return ConfigError(f"{key}={match['target']!r} cannot be imported: {import_failure(error)}")
    match = FAILED_CALL.match(str(error))
    cause = error.__cause__
    if match is None or not isinstance(cause, Exception):
        return None
    if isinstance(cause, TypeError) and WRONG_ARGUMENTS.search(str(cause)):
        return ConfigError(f"{match['key'] or 'a config node'}: {match['target']} does not take its arguments: {cause}")
    if match["target"].split(".")[0] == "retrain":  # our own part raising as it is built: a bug in retrain
        return None
    key = f"{match['key']}._target_" if match["key"] else "_target_"
    return PluginError(f"{key}={match['target']!r} raised {type(cause).__name__} as it was built: {cause}")


def one_line(error: BaseException) -> str:
    """The error's message with its lines joined: what the console shows of a user's mistake."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def failure_line(error: BaseException) -> str:
    """What status.json records of a run's error: the user's mistake as the console shows it, else the type and message."""
    user_error = user_error_behind(error)
    if user_error is not None:
        return one_line(user_error)
    return f"{type(error).__name__}: {one_line(error)}"
