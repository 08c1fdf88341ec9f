"""A plugin module that cannot be imported: it needs a package that is not installed (tests/test_launch_safety.py)."""

from __future__ import annotations

import retrain_tests_dependency_not_installed  # noqa: F401


def reward(response: str, reference: str, **extra: object) -> float:
    return 0.0


class Backend:
    pass
