"""A built-in part takes its settings as one object of its schema, or as that schema's fields as keywords.

The schema dataclass (e.g. ArithmeticDataConfig) is the only owner of a part's settings: their names, types,
defaults and checks (its `__post_init__`). retrain's own code hands a built-in that object; Hydra's plain
`instantiate(cfg.data, seed=seed)` hands it the config's keys as keywords, as it does to any plugin. A class
marked `@takes_settings(Schema)` accepts both: keywords are converted through the schema here, once, so the
class itself only ever sees the settings object.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from retrain.errors import ConfigError

C = TypeVar("C", bound=type)


def settings_from(schema: type, values: Mapping[str, Any], owner: str) -> Any:
    """`schema`'s object from `values` (its fields, as keywords): types checked and converted as at compose time,
    unset fields at their defaults, `__post_init__` run. A keyword that is no field is a ConfigError naming it."""
    known = [field.name for field in dataclasses.fields(schema)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{owner} has no setting {', '.join(map(repr, unknown))} ({schema.__name__} has: "
            f"{', '.join(name for name in known if not name.startswith('_'))}){hint}"
        )
    try:
        node = OmegaConf.merge(OmegaConf.structured(schema), dict(values))
    except ValidationError as error:
        raise ConfigError(f"{owner}: {error.msg} (setting {error.key!r} of {schema.__name__})") from error
    return OmegaConf.to_object(node)


def takes_settings(schema: type) -> Callable[[C], C]:
    """Let a class whose `__init__(self, settings, *run_objects)` takes a `schema` object also be called with the
    schema's fields as keywords beside the run objects (a tokenizer, the seed, ...), as Hydra calls it."""

    def decorate(cls: C) -> C:
        init = vars(cls)["__init__"]  # its own, which takes the settings object
        parameters = list(inspect.signature(init).parameters)  # self, the settings object, the run objects
        settings_name, run_objects = parameters[1], set(parameters[2:])
        shared = run_objects & {field.name for field in dataclasses.fields(schema)}
        if shared:  # a keyword could not tell a setting from a run object
            raise TypeError(f"{cls.__qualname__}: settings {sorted(shared)} of {schema.__name__} shadow arguments")

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if args or settings_name in kwargs:  # the settings object itself
                init(self, *args, **kwargs)
                return
            settings = {key: kwargs.pop(key) for key in list(kwargs) if key not in run_objects}
            init(self, settings_from(schema, settings, type(self).__qualname__), **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate
