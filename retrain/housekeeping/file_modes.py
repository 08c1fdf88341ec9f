"""Files a run writes follow the umask, as any new file does.

safetensors' `save_file` (and so PEFT's and transformers' `save_pretrained`) creates its file 0600, and
`tempfile.mkdtemp` its dir 0700: under umask 022 a checkpoint's weights would be the only files of a run
that a group's other users cannot read. Whatever writes model files into a dir calls `follow_umask` on it.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (changing it, even for an instant,
    would give a file another thread creates meanwhile the wrong mode)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o077)
    os.umask(current)
    return current


def follow_umask(root: Path) -> None:
    """Give `root` and everything under it the mode a new file (0666) or dir (0777) gets under the umask."""
    mask = current_umask()
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
