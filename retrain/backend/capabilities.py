"""What each backend is and needs, readable before any model loads: capabilities, options, extra.

`retrain backends`, `retrain explain`, `retrain doctor` and the trainer's startup line read it. A
built-in declares its capabilities on its class and its options as the fields of its config schema.
A user's backend named by `_target_` declares them through the metadata hooks of docs/backends.md, on the class or on its
module (a value, or a callable returning one); without them it gets conservative capabilities
(`preserves_token_advantages=False`), so token-varying algorithms fail preflight instead of silently
losing their credit assignment, and the source says `plugin/default`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from retrain.backend.base import CONSERVATIVE_CAPABILITIES, Capabilities
from retrain.errors import ConfigError
from retrain.plugins import definition

CAPABILITY_HOOKS = ("retrain_backend_capabilities", "RETRAIN_BACKEND_CAPABILITIES")
OPTION_SCHEMA_HOOKS = ("retrain_backend_option_schema", "RETRAIN_BACKEND_OPTION_SCHEMA")
HOOK_NAMES = (*CAPABILITY_HOOKS, *OPTION_SCHEMA_HOOKS)
CAPABILITY_KEYS = tuple(f.name for f in dataclasses.fields(Capabilities))


@dataclass(frozen=True)
class OptionSpec:
    """One `backend.<name>` key: its type, default, allowed values and meaning."""

    name: str
    type: str
    default: Any = None
    choices: tuple[Any, ...] | None = None
    help: str = ""
    validator: Callable[[Any], Any] | None = field(default=None, compare=False)
    required: bool = False  # an empty value ("" or None) is refused

    def check(self, value: Any) -> None:
        """ConfigError naming `backend.<name>` when `value` is not allowed."""
        if self.required and value in ("", None):
            raise ConfigError(f"backend.{self.name} is required: {self.help or 'give it a value'}")
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(map(str, self.choices))
            raise ConfigError(f"backend.{self.name}={value!r} is not one of: {allowed}")
        if self.validator is None:
            return
        try:
            verdict = self.validator(value)
        except (ValueError, TypeError) as error:
            raise ConfigError(f"backend.{self.name}={value!r}: {error}") from error
        if verdict is False:
            raise ConfigError(f"backend.{self.name}={value!r} is refused by the backend's validator")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "default": self.default,
            "choices": self.choices,
            "required": self.required,
            "help": self.help,
        }


@dataclass(frozen=True)
class BuiltinBackend:
    """A backend retrain ships: where it lives, the extra it needs and the modules that extra provides."""

    target: str
    schema: str  # dotted path of its config dataclass
    extra: str | None = None
    modules: tuple[str, ...] = ()


BUILTIN_BACKENDS: dict[str, BuiltinBackend] = {
    "local": BuiltinBackend("retrain.backend.local.LocalBackend", "retrain.backend.config.LocalBackendConfig"),
    "tinker": BuiltinBackend(
        "retrain.backend.tinker.backend.TinkerBackend",
        "retrain.backend.tinker.config.TinkerBackendConfig",
        extra="tinker",
        modules=("tinker",),
    ),
    "prime_rl": BuiltinBackend(
        "retrain.backend.prime_rl.backend.PrimeRlBackend",
        "retrain.backend.prime_rl.config.PrimeRlBackendConfig",
        extra="prime_rl",
        modules=("msgspec", "zmq"),
    ),
}


@dataclass(frozen=True)
class BackendInfo:
    """Everything `retrain backends` reports about one backend."""

    name: str
    target: str
    capabilities: Capabilities
    source: str  # "builtin" | "plugin/hook" | "plugin/default"
    options: dict[str, OptionSpec]
    extra: str | None
    extra_installed: bool
    options_declared: bool = True  # False: a plugin without an option schema, whose keys cannot be checked

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "capabilities": self.capabilities.as_dict(),
            "source": self.source,
            "options": {name: spec.as_dict() for name, spec in self.options.items()},
            "extra": self.extra,
            "install": f"pip install 'retrain[{self.extra}]'" if self.extra else None,
            "extra_installed": self.extra_installed,
        }

    def check_options(self, settings: Mapping[str, Any]) -> None:
        """ConfigError for a `backend.*` value its schema refuses, a required one left empty, or a key a
        declared schema lacks."""
        for name, option in self.options.items():
            if option.required and name not in settings:
                option.check(None)
        for key, value in settings.items():
            if key == "_target_":
                continue
            spec = self.options.get(key)
            if spec is None:
                if self.options_declared:  # a schema was declared: anything else is a typo
                    known = ", ".join(sorted(self.options)) or "none"
                    raise ConfigError(f"unknown config key 'backend.{key}' for backend {self.name} (known: {known})")
                continue
            spec.check(value)


def builtin_backends() -> list[BackendInfo]:
    """Every backend retrain ships, described."""
    return [describe_backend(builtin.target) for builtin in BUILTIN_BACKENDS.values()]


def describe_backend(backend: str | type | object) -> BackendInfo:
    """A backend's info from its `_target_`, its class or an instance (ConfigError when it does not import)."""
    cls = _backend_class(backend) if isinstance(backend, str) else _class_of(backend)
    target = _qualified_name(cls)
    builtin_name = next((name for name, b in BUILTIN_BACKENDS.items() if b.target == target), None)
    if builtin_name is not None:
        builtin = BUILTIN_BACKENDS[builtin_name]
        return BackendInfo(
            name=builtin_name,
            target=target,
            capabilities=capabilities_of(cls),
            source="builtin",
            options=schema_options(_import_attribute(builtin.schema)),
            extra=builtin.extra,
            extra_installed=all(importlib.util.find_spec(module) is not None for module in builtin.modules),
        )
    declared = _hook(cls, CAPABILITY_HOOKS)
    options = _hook(cls, OPTION_SCHEMA_HOOKS)
    return BackendInfo(
        name=target,
        target=target,
        capabilities=CONSERVATIVE_CAPABILITIES if declared is None else _as_capabilities(declared, target),
        source="plugin/default" if declared is None and options is None else "plugin/hook",
        options={} if options is None else _as_option_schema(options, target),
        extra=None,
        extra_installed=True,
        options_declared=options is not None,
    )


def capabilities_of(backend: type | object) -> Capabilities:
    """The capabilities a backend class (or instance) declares: a built-in's `capabilities`
    attribute, a plugin's hook, else the conservative defaults."""
    cls = _class_of(backend)
    if _qualified_name(cls) in {b.target for b in BUILTIN_BACKENDS.values()}:
        declared = cls.__dict__.get("capabilities")
        if isinstance(declared, Capabilities):
            return declared
    hooked = _hook(cls, CAPABILITY_HOOKS)
    return CONSERVATIVE_CAPABILITIES if hooked is None else _as_capabilities(hooked, _qualified_name(cls))


def schema_options(schema: type) -> dict[str, OptionSpec]:
    """The options of a built-in's config dataclass: every field but `_target_`, with its metadata."""
    options = {}
    for spec in dataclasses.fields(schema):
        if spec.name == "_target_":
            continue
        if spec.default is not dataclasses.MISSING:
            default = spec.default
        elif spec.default_factory is not dataclasses.MISSING:
            default = spec.default_factory()
        else:
            default = None
        choices = spec.metadata.get("choices")
        options[spec.name] = OptionSpec(
            name=spec.name,
            type=spec.type if isinstance(spec.type, str) else getattr(spec.type, "__name__", str(spec.type)),
            default=default,
            choices=None if choices is None else tuple(choices),
            help=spec.metadata.get("help", ""),
            validator=spec.metadata.get("validator"),
            required=bool(spec.metadata.get("required", False)),
        )
    return options


def _hook(cls: type, names: tuple[str, ...]) -> Any:
    """The first hook found on the class, then on its module; a callable hook is called."""
    module = importlib.import_module(cls.__module__)
    for owner in (cls, module):
        for name in names:
            value = getattr(owner, name, None)
            if value is None:
                continue
            if callable(value) and not isinstance(value, Capabilities) and not inspect.isclass(value):
                value = value()
            return value
    return None


def _as_capabilities(declared: Any, target: str) -> Capabilities:
    if isinstance(declared, Capabilities):
        return declared
    if isinstance(declared, Mapping):
        unknown = set(declared) - set(CAPABILITY_KEYS)
        if unknown:
            raise ConfigError(
                f"backend {target} declares unknown capabilities {sorted(unknown)} (known: {', '.join(CAPABILITY_KEYS)})"
            )
        merged = {**CONSERVATIVE_CAPABILITIES.as_dict(), **{k: bool(v) for k, v in declared.items()}}
        return Capabilities(**merged)
    raise ConfigError(
        f"backend {target}: {CAPABILITY_HOOKS[0]} must be a Capabilities or a dict, got {type(declared).__name__}"
    )


def _as_option_schema(declared: Any, target: str) -> dict[str, OptionSpec]:
    if not isinstance(declared, Mapping):
        raise ConfigError(f"backend {target}: {OPTION_SCHEMA_HOOKS[0]} must be a mapping of option specs")
    options = {}
    for name, spec in declared.items():
        if isinstance(spec, OptionSpec):
            options[name] = spec
        elif isinstance(spec, Mapping):
            kind = spec.get("type", spec.get("value_type", "any"))
            choices = spec.get("choices")
            options[name] = OptionSpec(
                name=name,
                type=kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind)),
                default=spec.get("default"),
                choices=None if choices is None else tuple(choices),
                help=str(spec.get("help", "")),
                validator=spec.get("validator"),
                required=bool(spec.get("required", False)),
            )
        else:
            raise ConfigError(
                f"backend {target}: option {name!r} must be an OptionSpec or a dict "
                f"{{type|value_type, default, choices?, validator?}}, got {type(spec).__name__}"
            )
    return options


def _backend_class(target: str) -> type:
    try:
        value = _import_attribute(target)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"backend._target_={target!r} cannot be imported: {error}") from error
    if not inspect.isclass(value):
        raise ConfigError(f"backend._target_={target!r} is not a class")
    return value


def _import_attribute(dotted: str) -> Any:
    module_name, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


def _class_of(backend: Any) -> type:
    """A class itself; an instance's class, through retrain's checking wrappers."""
    if inspect.isclass(backend):
        return backend
    found = definition(backend)
    return found if inspect.isclass(found) else type(found)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
