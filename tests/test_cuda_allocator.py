"""A run asks CUDA's allocator for expandable segments before CUDA initialises, unless the user configured it."""

from __future__ import annotations

import os
import subprocess
import sys

from retrain.model.cuda_allocator import ALLOC_CONF_VARIABLES, EXPANDABLE_SEGMENTS, use_expandable_segments


def test_expandable_segments_are_asked_for_where_the_user_set_nothing() -> None:
    environ: dict[str, str] = {}
    assert use_expandable_segments(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": EXPANDABLE_SEGMENTS}


def test_the_users_own_allocator_setting_wins_under_either_name() -> None:
    for name in ALLOC_CONF_VARIABLES:
        environ = {name: "max_split_size_mb:512"}
        assert not use_expandable_segments(environ)
        assert environ == {name: "max_split_size_mb:512"}


def test_the_cli_asks_for_them() -> None:
    """The variable is read when CUDA initialises: `retrain`'s entry sets it before it composes or builds anything."""
    script = (
        "import sys, os\n"
        "from retrain.cli import main\n"
        "try:\n"
        "    main(['--cfg', 'job', 'backend=local'])\n"
        "finally:\n"
        "    print('ALLOC', os.environ.get('PYTORCH_ALLOC_CONF'), file=sys.stderr)\n"
    )
    environ = {key: value for key, value in os.environ.items() if key not in ALLOC_CONF_VARIABLES}
    done = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120)
    assert f"ALLOC {EXPANDABLE_SEGMENTS}" in done.stderr, done.stderr[-2000:]
