"""Config-file values converted to their setting's type, or refused with the setting's name.

Flags are typed by the parser; a YAML or JSON file gives whatever its syntax makes of a value
(``batch_size: eight`` a string, ``learning_rate: 1e-4`` a string under YAML 1.1, ``batch_size:``
nothing at all). :func:`convert_settings` turns each value into the type the dataclass field declares,
the way the flag would have read it, and refuses what cannot be one with a line that names the
setting, the value and the expected form.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class SettingError(ValueError):
    """A config-file value that is not of its setting's type."""


def convert_settings(dataclass_type: type, settings: dict[str, Any], source: str) -> dict[str, Any]:
    """``settings`` with every value converted to its field's type in ``dataclass_type``."""
    hints = typing.get_type_hints(dataclass_type)
    fields = {field.name for field in dataclasses.fields(dataclass_type)}
    return {
        name: _convert(hints[name], value, f"{source}: {name}") for name, value in settings.items() if name in fields
    }


def convert_setting(dataclass_type: type, field_name: str, value: Any, where: str) -> Any:
    """One value converted to the type of ``dataclass_type``'s field ``field_name``; errors name ``where``."""
    return _convert(typing.get_type_hints(dataclass_type)[field_name], value, where)


def _convert(annotation: Any, value: Any, where: str) -> Any:
    options = _union_members(annotation)
    if options is not None:
        if value is None and type(None) in options:
            return None
        for option in (member for member in options if member is not type(None)):
            try:
                return _convert(option, value, where)
            except SettingError:
                continue
        expected = " or ".join(_describe(member) for member in options)
        raise SettingError(f"{where}: expected {expected}, got {value!r}.")
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise SettingError(f"{where}: expected a list ({_describe(item)} each), e.g. [384, 128], got {value!r}.")
        return [_convert(item, element, where) for element in value]
    if annotation is bool:
        return _to_bool(value, where)
    if annotation in (int, float):
        return _to_number(annotation, value, where)
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise SettingError(f"{where}: expected text, got {value!r}.")
    return value


def _union_members(annotation: Any) -> tuple | None:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return None


def _describe(annotation: Any) -> str:
    return {int: "an integer", float: "a number", str: "text", bool: "true or false", type(None): "nothing"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _to_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE + _FALSE:
        return word in _TRUE
    raise SettingError(f"{where}: expected true or false, got {value!r}.")


def _to_number(kind: type, value: Any, where: str) -> int | float:
    if isinstance(value, bool) or value is None:
        raise SettingError(f"{where}: expected {_describe(kind)}, got {value!r}.")
    try:
        return float(value) if kind is float else _exact_int(value)
    except (TypeError, ValueError):
        raise SettingError(f"{where}: expected {_describe(kind)}, got {value!r}.") from None


def _exact_int(value: Any) -> int:
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(value)
        return int(value)
    return int(str(value).strip())
