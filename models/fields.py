"""Strict types for the fields of every config dataclass, checked on creation.

A config field's annotation is its type, and nothing else is accepted: a string is never a boolean
("false" is not false), a boolean never a number, a float never an integer, and a float must be
finite (no NaN, no infinity). pydantic checks each value against the annotation in strict mode; the
dataclass's own `__post_init__` then checks what the types cannot say (ranges, choices, combinations).
Fields whose annotation is another config (a Scenario's model and setup) are checked by their own class.

A field is named in files, flags and messages by its key: its Python name, or the `key` in its metadata where
the two differ (TransformerConfig.architecture is written `family`, the key users wrote before the attribute
was renamed). `keys_of`, `as_keys` and `by_name` are the one translation between the two.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

from pydantic import ConfigDict, TypeAdapter, ValidationError

STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def _words(tp) -> str:
    """An annotation in words, for the error message."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [_words(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" (or left out)" if type(None) in args else "")
    if origin is tuple:
        return f"a list of {_words(args[0]).replace('an ', '').replace('a ', '')}s"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(tp, str(tp))


@functools.cache
def _adapters(cls) -> tuple[tuple[str, object, TypeAdapter], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        parts = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        if any(dataclasses.is_dataclass(p) or getattr(p, "CHECKS_ITSELF", False) for p in parts):
            continue  # another config: it checks itself
        out.append((f.name, tp, TypeAdapter(tp, config=STRICT)))
    return tuple(out)


@functools.cache
def _adapter(tp) -> TypeAdapter:
    return TypeAdapter(tp, config=STRICT)


def check_value(name: str, tp, value, error: type[Exception]) -> None:
    """Raise `error(name, message)` when `value` is not strictly of type `tp`."""
    try:
        _adapter(tp).validate_python(value)
    except ValidationError:
        raise error(name, f"must be {_words(tp)}, got {value!r} ({type(value).__name__})") from None


def check_types(obj, error: type[Exception]) -> None:
    """Raise `error(key, message)` for the first field of dataclass `obj` whose value is not strictly
    of its annotated type."""
    keys = {name: key for key, name in keys_of(type(obj)).items()}
    for name, tp, adapter in _adapters(type(obj)):
        value = getattr(obj, name)
        try:
            adapter.validate_python(value)
        except ValidationError:
            raise error(keys[name], f"must be {_words(tp)}, got {value!r} ({type(value).__name__})") from None


@functools.cache
def keys_of(cls) -> dict[str, str]:
    """The fields of dataclass `cls` as files, flags and messages name them: key -> Python name, in field order."""
    return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}


def as_keys(obj) -> dict:
    """`dataclasses.asdict(obj)` with each field under its key."""
    values = dataclasses.asdict(obj)
    return {key: values[name] for key, name in keys_of(type(obj)).items()}


def by_name(cls, table: dict) -> dict:
    """A table of `cls`'s fields by key (a scenario file's [model], a trace's metadata) by Python name, to
    construct or replace with; a key that is no field stays as it is (the constructor refuses it)."""
    names = keys_of(cls)
    return {names.get(k, k): v for k, v in table.items()}


def in_keys(cls, message: str) -> str:
    """A TypeError's message about `cls`'s fields ("missing 1 required positional argument: 'architecture'")
    naming them by key."""
    for key, name in keys_of(cls).items():
        if key != name:
            message = message.replace(f"'{name}'", f"'{key}'")
    return message


__all__ = ["check_types", "keys_of", "as_keys", "by_name", "in_keys"]
