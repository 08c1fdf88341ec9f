"""The project's own error types, so callers can tell a user's mistake from a bug or an outage."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configured value is wrong; the message names the key (e.g. `data.path`) and the value."""


class RewardOutputError(ValueError):
    """A reward returned something other than one finite real number: a bug in the reward itself."""


class RewardWorkerError(RuntimeError):
    """A scoring worker process could not load the reward (raised when the scorer starts)."""


class HubFetchError(RuntimeError):
    """Something could not be fetched from the Hugging Face Hub (offline, unknown id, ...)."""
