"""Hub ids vs local paths, and Hub fetches that fail fast and say what to do when offline.

Left alone, `datasets` and `huggingface_hub` retry an unreachable Hub with exponential back-off
(about 25 s for one dataset, more for a model's several files) before failing with a generic
error. `hub_fetch` first probes the endpoint with a short timeout (once per process), and turns
any failed fetch into a HubFetchError that names what could not be fetched and how to carry on.
"""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from huggingface_hub import constants as hub_constants

from retrain.errors import ConfigError, HubFetchError

PROBE_TIMEOUT_S = 3.0
# The suffixes that make a string a file name, not a Hub repo name (which may contain dots too).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def local_path(ref: str, setting: str) -> Path | None:
    """`ref` as an existing local path, or None when it is a Hub repo id.

    A string that looks like a path (starts with `/`, `.` or `~`, or ends in a data-file suffix)
    but does not exist is a ConfigError naming `setting`, not a Hub lookup.
    """
    path = Path(ref).expanduser()
    if path.exists():
        return path
    looks_like_path = ref.startswith(("/", ".", "~")) or ref.lower().endswith(DATA_FILE_SUFFIXES)
    if looks_like_path or not _HUB_ID.match(ref) or ".." in ref:
        raise ConfigError(f"{setting}={ref!r}: no such file or directory (and not a Hub repo id)")
    return None


@contextmanager
def hub_fetch(repo_id: str, kind: str, setting: str) -> Iterator[None]:
    """Guard a Hub download of `repo_id` (a `kind`: "dataset", "model", ...) configured by `setting`.

    Raises HubFetchError at once when the Hub cannot be reached, and turns an OSError raised inside
    the block (the family of every connection, offline-mode and not-found error of `datasets`,
    `huggingface_hub` and `transformers`) into one. With HF_HUB_OFFLINE=1 the probe is skipped:
    the libraries then read their local cache only.
    """
    if not hub_constants.HF_HUB_OFFLINE and not hub_reachable(hub_constants.ENDPOINT):
        raise HubFetchError(_fetch_message(repo_id, kind, setting, f"{hub_constants.ENDPOINT} is unreachable"))
    try:
        yield
    except OSError as exc:
        raise HubFetchError(_fetch_message(repo_id, kind, setting, f"{type(exc).__name__}: {exc}")) from exc


@lru_cache(maxsize=4)
def hub_reachable(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether an HTTP request to `endpoint` gets any answer within `timeout_s` (proxies honoured).

    The request runs in a daemon thread so that a hanging DNS lookup, which socket timeouts do not
    cover, cannot hold us past `timeout_s` either.
    """
    answered = threading.Event()

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
            answered.set()
        except urllib.error.HTTPError:  # any HTTP status means the host is there
            answered.set()
        except OSError:
            pass

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answered.is_set()


def _fetch_message(repo_id: str, kind: str, setting: str, reason: str) -> str:
    # One line: Hydra shows a failed instantiation's error as its repr, which would escape newlines.
    cache_note = (
        "HF_HUB_OFFLINE is set, and the Hugging Face cache holds no copy of it"
        if hub_constants.HF_HUB_OFFLINE
        else "with HF_HUB_OFFLINE=1, a copy already in the Hugging Face cache is used"
    )
    return (
        f"Could not fetch {kind} '{repo_id}' from the Hugging Face Hub ({reason}). Offline? Try the "
        f"offline demo, `python -m retrain experiment=quickstart`, or point {setting} at a local "
        f"directory or file ({cache_note})."
    )
