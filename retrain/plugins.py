"""Plugins are held to their contract, whatever they are: one checking wrapper, one naming helper.

A part of ours (an advantage, a transform, the pipeline, the local backend, ...) is trusted by
identity: it is marked `@built_in` where it is defined. Any other part, a subclass of ours
included, is wrapped by `checked` where it is built, so every output of its contract methods is
checked against what the caller passed in, and a wrong shape or a NaN fails at once, naming the
plugin, instead of surfacing steps later as a silent broadcast or a diverged adapter.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from hydra.utils import get_object

from retrain.errors import UserError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# A contract check: (output, what, args, kwargs) -> the output the caller gets (checked, maybe cleaned).
# `what` names the plugin in errors, e.g. "transform algorithm.transforms.clip (my_module.Clip)".
Check = Callable[[Any, str, tuple[Any, ...], dict[str, Any]], Any]

_BUILT_IN: set[Any] = set()
_MISSING = object()


def built_in(part: T) -> T:
    """Mark a function or class as retrain's own: its outputs need no contract check."""
    _BUILT_IN.add(part)
    return part


def definition(part: Any) -> Any:
    """The function or class behind a part: through checking wrappers and partials, an instance's class."""
    while True:
        if isinstance(part, Checked):
            part = part.plugin
        elif isinstance(part, functools.partial):
            part = part.func
        else:
            break
    if inspect.isfunction(part) or inspect.isclass(part) or inspect.ismethod(part) or inspect.isbuiltin(part):
        return part
    return type(part)


def is_built_in(part: Any) -> bool:
    """True only for parts defined by retrain itself (a user's subclass of ours is a plugin)."""
    return definition(part) in _BUILT_IN


def plugin_name(part: Any) -> str:
    """Dotted name of a function, class, instance, method or partial (what a user wrote in `_target_`)."""
    target = definition(part)
    return f"{target.__module__}.{target.__qualname__}"


RAISED_IN = "raised in the plugin "  # the note an exception out of a Checked part carries


class Checked:
    """A plugin, with the outputs of its contract methods checked; everything else passes through.

    `checks` maps a method name (`__call__` for a callable part) to its contract check. Attribute
    reads (declarations such as `token_varying`, settings, other methods) reach the plugin itself,
    or the function of a partial.
    """

    def __init__(self, plugin: Any, checks: Mapping[str, Check], what: str) -> None:
        self.plugin = plugin
        self.checks = dict(checks)
        self.what = what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run("__call__", self.plugin, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("plugin", "checks", "what"):  # copy/pickle probes, unset fields
            raise AttributeError(name)
        value = declared(self.plugin, name, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"{self.what} has no attribute {name!r}")
        if name not in self.checks:
            return value

        def checked_method(*args: Any, **kwargs: Any) -> Any:
            return self._run(name, value, args, kwargs)

        return checked_method

    def _run(self, method: str, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            output = function(*args, **kwargs)
        except Exception as error:
            _note_raised_in(error, self.what)
            raise
        return self.checks[method](output, self.what, args, kwargs)

    def __repr__(self) -> str:
        return f"Checked({self.plugin!r})"


def checked(part: T, checks: Mapping[str, Check], what: str) -> T:
    """`part` itself when it is built in, else the part wrapped so its outputs meet `checks`."""
    if is_built_in(part):
        return part
    return Checked(part, checks, what)  # type: ignore[return-value]  # it offers the part's interface


class PluginOutputError(UserError, ValueError):
    """A pluggable part (advantage, uncertainty, transform, algorithm, engine, backend) returned unusable output."""


class PluginError(UserError, RuntimeError):
    """A pluggable part raised: the bug is in the plugin, whose traceback goes to the run's log."""


def _note_raised_in(error: Exception, what: str) -> None:
    """Name the plugin an exception came out of, keeping its type (the OOM and retry handlers above
    still catch what they catch); the innermost plugin is the one named."""
    if not isinstance(error, UserError) and raised_in_plugin(error) is None:
        error.add_note(f"{RAISED_IN}{what}")


def raised_in_plugin(error: BaseException) -> str | None:
    """The plugin `error` came out of (see Checked), or None."""
    notes = getattr(error, "__notes__", None) or []
    return next((note[len(RAISED_IN) :] for note in notes if note.startswith(RAISED_IN)), None)


def check_shape(value: Any, shape: tuple[int, ...], *, what: str) -> torch.Tensor:
    """`value` must be a floating-point tensor of exactly `shape` (no silent broadcasting)."""
    import torch  # here: the config schemas mark their parts built in, and composing a config loads no torch

    if not isinstance(value, torch.Tensor):
        raise PluginOutputError(
            f"{what} returned {type(value).__name__}, expected a torch.Tensor of shape {list(shape)}"
        )
    if tuple(value.shape) != shape:
        raise PluginOutputError(f"{what} returned shape {list(value.shape)}, expected {list(shape)}")
    if not value.is_floating_point():
        raise PluginOutputError(f"{what} returned dtype {value.dtype}, expected a floating-point tensor")
    return value


def check_finite(value: torch.Tensor, *, what: str) -> torch.Tensor:
    """Every entry finite. A finite row-sum proves it cheaply; only a failure pays for the search."""
    import torch

    if bool(torch.isfinite(value.sum(dim=-1)).all()) or bool(torch.isfinite(value).all()):
        return value
    index = tuple(int(i) for i in (~torch.isfinite(value)).nonzero()[0])
    raise PluginOutputError(f"{what} returned non-finite values (e.g. {float(value[index])} at index {list(index)})")


def locate(path: str) -> Any:
    """The object at a dotted path (hydra.utils.get_object) without Hydra's own error line: the caller
    reports a failure once, naming the key."""
    hydra_log = logging.getLogger("hydra.utils")
    level = hydra_log.level
    hydra_log.setLevel(logging.CRITICAL)
    try:
        return get_object(path)
    finally:
        hydra_log.setLevel(level)


def import_failure(error: BaseException) -> str:
    """Why a `_target_` did not import, from the error Hydra wraps it in ("Error locating target ..."):
    what does not exist, or the error the plugin's own module raised while importing (a dependency
    that is not installed, a bad import in it), with the module and line that raised it."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    innermost = root.__traceback__
    while innermost is not None and innermost.tb_next is not None:
        innermost = innermost.tb_next
    frame = innermost.tb_frame if innermost is not None else None
    module = str(frame.f_globals.get("__name__", "")) if frame is not None else ""
    if frame is None or module.startswith(("hydra.", "importlib")) or frame.f_code.co_filename.startswith("<"):
        return _missing_name(root) or f"{type(root).__name__}: {root}"  # raised by the lookup itself
    return (
        f"importing {module} raised {type(root).__name__}: {root} "
        f"({frame.f_code.co_filename}, line {innermost.tb_lineno})"  # type: ignore[union-attr]
    )


def _missing_name(error: BaseException) -> str | None:
    """For `module.nme` where the module imports but holds no `nme`: Hydra's lookup last tries it as a
    submodule, and "No module named 'module.nme'; 'module' is not a package" misleads. Say what is
    missing instead, with the closest name the module does hold."""
    if not isinstance(error, ModuleNotFoundError) or not error.name or "." not in error.name:
        return None
    parent, _, name = error.name.rpartition(".")
    module = sys.modules.get(parent)
    if module is None:
        return None
    public = [held for held in dir(module) if not held.startswith("_")]
    close = difflib.get_close_matches(name, public, n=1)
    return f"module {parent!r} has no {name!r}" + (f"; did you mean {close[0]!r}?" if close else "")


def declared(part: Any, attribute: str, default: Any) -> Any:
    """An attribute a part declares on itself (looked up through partials and wrappers), else `default`."""
    if hasattr(part, attribute):
        return getattr(part, attribute)
    if isinstance(part, functools.partial):
        return getattr(part.func, attribute, default)
    return default
