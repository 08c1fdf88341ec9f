"""The project's own error types, so callers can tell a user's mistake from a bug or an outage.

A `UserError` is caused by the user's config, data, plugin or network, and its message says what to
fix: the command line prints that message alone and exits 1, and writes the traceback to the run's
log (retrain/cli.py). Anything else is a bug in retrain and keeps its traceback on the console.
"""

from __future__ import annotations

import re

# what Python says when a callable gets arguments it does not take: in a user's part, a config mistake
WRONG_ARGUMENTS = re.compile(
    r"unexpected keyword argument|missing \d+ required (?:positional|keyword-only) argument|"
    r"takes (?:from \d+ to )?\d+ positional arguments? but \d+ (?:were|was) given"
)


class UserError(Exception):
    """Base of every error the user can fix without touching retrain (see the module docstring)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details  # more than the message needs (e.g. a worker's traceback): logged, not printed


class ConfigError(UserError, ValueError):
    """A configured value is wrong; the message names the key (e.g. `data.path`) and the value."""


class ConfigErrors(ConfigError):
    """Several wrong values reported at once, each problem naming its key, so one launch shows them all."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        several = f"{len(problems)} config values cannot work: " + "; ".join(problems)
        super().__init__(problems[0] if len(problems) == 1 else several)

    def __reduce__(self) -> tuple[type[ConfigErrors], tuple[list[str]]]:
        return (type(self), (self.problems,))  # rebuilt from its problems, not from its message


def refuse_all(problems: list[str]) -> None:
    """Raise ConfigErrors for `problems`; return when there are none."""
    if problems:
        raise ConfigErrors(problems)


class DataError(UserError, ValueError):
    """A data file or data set could not be read (malformed records, an unreadable file)."""


class RewardOutputError(UserError, ValueError):
    """A reward returned something other than one finite real number: a bug in the reward itself."""


class RewardWorkerError(UserError, RuntimeError):
    """A scoring worker process could not load the reward (raised when the scorer starts)."""


class RewardFailureError(UserError, RuntimeError):
    """The reward scored none of a step's completions for `scoring.max_failing_steps` steps in a row."""


class HubFetchError(UserError, RuntimeError):
    """Something could not be fetched from the Hugging Face Hub (offline, unknown id, ...)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be restored (damaged files) or written (a full disk); the message names it."""
