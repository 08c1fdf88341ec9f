"""What of a config is private, and the config as it may be shown or saved: env values unresolved, secrets masked.

Two kinds of value never leave the process that resolved them (wandb, saved files, messages, a run's identity):

- a value read from the environment (`${oc.env:MY_TOKEN}`, also inside a string or through another key
  that interpolates it) is kept as the interpolation the user wrote, never as what it resolves to;
- the value of a key whose name has the word key, token, secret or password in it (`api_key`, `hf_token`,
  `client_secret`; not `max_tokens`) is shown as `***`. A `*_env` key names a variable, never holds its
  value, so it is shown, and a value that does not look like a variable's name is refused;
- whatever the key, a secret recognised by its shape (`mask_text`): the credentials of a url
  (`http://user:pass@host` -> `http://***@host`), a `Bearer`/`Basic` credential or an `Authorization:`
  header, an API key shaped like OpenAI's or Hugging Face's (`sk-...`, `hf_...`), and `key=value` text
  whose key looks secret (a sweep's overrides, Hydra's launch lines). `MaskingFilter` applies the same to
  every log line of a run and of a sweep's driver.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from retrain.errors import ConfigError

MASK = "***"
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"})
ENV_SUFFIX = "_env"  # `api_key_env`: the name of the variable that holds the key
ENV_INTERPOLATION = re.compile(r"\$\{\s*(?:oc\.env|env)\s*:")
UNESCAPED_INTERPOLATION = re.compile(r"(?<!\\)\$\{")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# `api_key`, `apiKey`, `hf-token` -> words; camelCase splits before each capital
_WORD_BOUNDARY = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")
# secrets by their shape, whatever key holds them (each keeps its group 1 and masks the rest)
# (Hydra escapes the colons of an override: `http\://user\:pass@host`). The user info runs to the LAST `@`
# before the host (RFC 3986: the host holds no `@`), so a password with an unencoded `@` (`user:p@ss@host`)
# is masked whole.
URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*\\*://)[^/?#\s'\"]+@")
AUTHORIZATION = re.compile(r"((?:proxy-)?authorization['\"]?\s*[:=]\s*['\"]?)[^'\",}\n]+", re.IGNORECASE)
SCHEME_CREDENTIAL = re.compile(r"\b((?:Bearer|Basic|Token)\s+)[A-Za-z0-9._~+/=\-]{6,}", re.IGNORECASE)
KEY_SHAPED = re.compile(r"\b(?:sk-[A-Za-z0-9_\-]{20,}|hf_[A-Za-z0-9]{30,})")  # OpenAI's and Hugging Face's
PLAIN_VALUES = frozenset({"true", "false", "none", "null", ""})
NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
# `key=value` in a command line or Hydra's override_dirname (`a=1,+reward.api_key=sk-1`): the value runs to
# whitespace, or to a comma that starts the next `key=`
KEY_VALUE = re.compile(r"(?<![\w.])([+~]?([A-Za-z_][\w.\-]*)=)((?:[^\s,'\"]|,(?![+~]?[A-Za-z_][\w.\-]*=))+)")


def looks_secret(key: str) -> bool:
    """Whether a (dotted) key's own name says it holds a secret."""
    name = key.rsplit(".", 1)[-1]
    if name.lower().endswith(ENV_SUFFIX):
        return False
    return any(word.lower() in SECRET_WORDS for word in _WORD_BOUNDARY.split(name))


def mask_text(text: str) -> str:
    """`text` with every secret recognised by its shape or its key replaced by `***` (module docstring)."""

    def key_value(match: re.Match[str]) -> str:
        key, value = match.group(2), match.group(3)
        bare = value.rstrip(",.;:)]}")
        if bare.lower() in PLAIN_VALUES or NUMBER.fullmatch(bare):
            return match.group(0)  # `preserves_token_advantages=false`: a flag or a count, never a secret
        if looks_secret(key) and not from_environment(value):
            return match.group(1) + MASK
        if key.lower().endswith(ENV_SUFFIX) and not ENV_NAME.match(value) and not from_environment(value):
            return match.group(1) + MASK  # not a variable's name: most likely the key itself, pasted in
        return match.group(0)

    text = URL_CREDENTIALS.sub(rf"\1{MASK}@", text)
    text = AUTHORIZATION.sub(rf"\1{MASK}", text)
    text = SCHEME_CREDENTIAL.sub(rf"\1{MASK}", text)
    text = KEY_SHAPED.sub(MASK, text)
    return KEY_VALUE.sub(key_value, text) if "=" in text else text


def masked_values(node: Any, key: str = "") -> Any:
    """A copy of a JSON-like report (explain, doctor, status) with its secrets masked: the string value of
    a secret-looking key unless it names a variable (doctor's `credentials: WANDB_API_KEY`), and every
    other string through `mask_text` (keys stay as they are)."""
    if isinstance(node, str):
        return mask_text(node) if ENV_NAME.match(node) else _masked(key, node)
    if isinstance(node, dict):
        return {name: masked_values(value, str(name)) for name, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [masked_values(value, key) for value in node]
    return node


class MaskingFilter(logging.Filter):
    """A log handler's filter that masks secrets in every record it passes (hydra's `job_logging` and
    `hydra_logging` in conf/config.yaml install it on the console and run.log handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:  # the traceback's messages too (run.log keeps tracebacks)
            record.exc_text = mask_text(logging.Formatter().formatException(record.exc_info))
        return True


class MaskedStream:
    """A text stream (sys.stderr) that masks what is written to it: Hydra writes a failed job's overrides there."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask_text(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def from_environment(value: Any) -> bool:
    """Whether a shown value (see `shown_config`) holds an environment interpolation, in a list or dict too."""
    if isinstance(value, str):
        return ENV_INTERPOLATION.search(value) is not None
    if isinstance(value, dict):
        return any(from_environment(v) for v in value.values())
    if isinstance(value, list):
        return any(from_environment(v) for v in value)
    return False


def shown_config(cfg: DictConfig) -> dict[str, Any]:
    """The config resolved, except that what comes from the environment stays the interpolation written,
    and the values of secret-looking keys are masked: what wandb, saved files and messages may hold."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    kept = OmegaConf.create(_walk(raw, "", _unresolved_env))
    shown: dict[str, Any] = _walk(OmegaConf.to_container(kept, resolve=True), "", _masked)
    return shown


def masked_config(cfg: DictConfig) -> DictConfig:
    """The config as written (interpolations unresolved), with the literal values of secret-looking keys masked."""
    return OmegaConf.create(_walk(OmegaConf.to_container(cfg, resolve=False), "", _masked))


def masked_override(override: str) -> str:
    """A command-line override (`+reward.api_key=sk-...`, `inference.url=http://u:p@host`) with a literal
    secret value masked, by its key or by its shape."""
    key, sep, value = override.partition("=")
    if sep and looks_secret(key.lstrip("+~")) and value and not from_environment(value):
        return f"{key}={MASK}"
    if sep and key.lower().endswith(ENV_SUFFIX) and value and not ENV_NAME.match(value):
        return f"{key}={MASK}"  # not a variable's name: most likely the key itself, pasted in (check_env_names)
    return mask_text(override)


def check_env_names(cfg: DictConfig) -> None:
    """A `*_env` key (`reward.api_key_env`) names an environment variable: a value that looks like anything
    else (most likely the key itself, pasted in) is refused before it is saved or shown anywhere."""

    def check(key: str, value: Any) -> Any:
        name = key.rsplit(".", 1)[-1]
        if name.lower().endswith(ENV_SUFFIX) and isinstance(value, str) and value and not ENV_NAME.match(value):
            raise ConfigError(
                f"{key} must name an environment variable (upper-case letters, digits and _, e.g. OPENAI_API_KEY), "
                "and the value given is not one; put the key itself in that variable, never in the config"
            )
        return value

    _walk(OmegaConf.to_container(cfg, resolve=False), "", check)


def _unresolved_env(key: str, value: Any) -> Any:
    """A string that reads the environment becomes a literal of itself (OmegaConf's `\\${` escape)."""
    if isinstance(value, str) and from_environment(value):
        return UNESCAPED_INTERPOLATION.sub(r"\\${", value)
    return value


def _masked(key: str, value: Any) -> Any:
    if looks_secret(key) and value not in (None, "") and not from_environment(value):
        return MASK
    return mask_text(value) if isinstance(value, str) else value


def _walk(node: Any, prefix: str, leaf: Any) -> Any:
    """A copy of a container with `leaf(dotted key, value)` applied to every scalar (a list's items under its key)."""
    if isinstance(node, dict):
        return {k: _walk(v, f"{prefix}.{k}" if prefix else str(k), leaf) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, prefix, leaf) for v in node]
    return leaf(prefix, node)
