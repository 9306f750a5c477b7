"""`type:`-keyed registries of config classes, decoded by draccus as choice types.

One way to declare a registry for every config family that YAML selects by `type:` (model families here,
optimizers in the training app). draccus recognises a choice type by four classmethods (`get_choice_class`,
`get_known_choices`, `get_choice_name`, `default_choice_name`); it is duck-typed, so this module does not
import draccus. The methods are installed on the base class itself because draccus looks for them on a class
none of whose bases has them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def config_registry(kind: str, *, default: str | None = None) -> Callable[[T], T]:
    """Class decorator: make `base` a registry of its subclasses by `type` name (`kind` names them in errors).

    After `@config_registry("model")`, `@Base.register_subclass("gpt2")` registers a subclass, and
    `Base.get_choice_class("gpt2")` finds it. `default` is the type used when YAML gives no `type:` key.
    """

    def install(base: T) -> T:
        choices: dict[str, type] = {}

        def register_subclass(cls: type, name: str) -> Callable[[type], type]:
            def register(subclass: type) -> type:
                if not (isinstance(subclass, type) and issubclass(subclass, base)):
                    raise TypeError(f"Only {base.__name__} subclasses can be registered as a {kind}, got {subclass!r}")
                existing = choices.get(name)
                if existing is not None and existing is not subclass:
                    raise ValueError(
                        f"{kind.capitalize()} type {name!r} is already registered to {existing.__qualname__}; "
                        f"pick another name for {subclass.__qualname__}"
                    )
                choices[name] = subclass
                return subclass

            return register

        def get_choice_class(cls: type, name: str) -> type:
            try:
                return choices[name]
            except KeyError:
                known = sorted(choices)
                close = difflib.get_close_matches(str(name), known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise KeyError(f"Unknown {kind} type {name!r}; known types are {known}.{hint}") from None

        def get_known_choices(cls: type) -> dict[str, type]:
            return dict(choices)

        def get_choice_name(cls: type, subcls: type) -> str:
            for name, registered in choices.items():
                if registered is subcls:
                    return name
            raise ValueError(f"{getattr(subcls, '__qualname__', subcls)!r} is not a registered {kind} config")

        def default_choice_name(cls: type) -> str | None:
            return default

        def unregister(cls: type, name: str) -> None:
            choices.pop(name, None)

        # Typed as plain callables: the six signatures differ, and classmethod() takes each one of them.
        methods: list[Callable[..., Any]] = [
            register_subclass,
            get_choice_class,
            get_known_choices,
            get_choice_name,
            default_choice_name,
            unregister,
        ]
        for fn in methods:
            fn.__doc__ = _DOCS[fn.__name__].format(kind=kind)
            setattr(base, fn.__name__, classmethod(fn))
        return base

    return install


_DOCS: dict[str, Any] = {
    "register_subclass": "Class decorator that registers a config class under a `type` name.",
    "get_choice_class": "The config class registered under `name`; a KeyError naming the known {kind} types.",
    "get_known_choices": "Every registered `type` name and its config class.",
    "get_choice_name": "The `type` name under which a config class is registered.",
    "default_choice_name": "The type used when a config gives no `type:` key (None: it must give one).",
    "unregister": "Remove a registered type (for tests that register a temporary one).",
}
