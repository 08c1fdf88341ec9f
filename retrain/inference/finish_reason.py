"""What a server's `finish_reason` says about a completion, the same for every OpenAI-style engine.

"length": cut at max_tokens (trained on as a cut completion); "stop" and the like: finished. "abort":
the server dropped the request mid-generation (vLLM on an engine abort or a client disconnect): the
tokens are a fragment, neither a finished nor a cut completion, so the run stops instead of training on it.
"""

from __future__ import annotations

from retrain.inference.http import HttpError

ABORTED = "abort"


def hit_max_tokens(url: str, finish_reason: object) -> bool:
    """Whether the completion was cut at max_tokens; HttpError naming the url for an aborted one."""
    if finish_reason == ABORTED:
        raise HttpError(
            "POST", url, "a completion ended with finish_reason='abort': the server aborted it mid-generation"
        )
    return finish_reason == "length"
