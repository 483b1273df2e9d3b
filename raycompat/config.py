"""Typed option sets with errors that name the bad key and the allowed values.

Every method and job declares its options as a dataclass; ``parse_options`` turns a plain
dict (from JSON or the command line) into it, or raises ``ConfigError`` before any torch
code runs.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what is allowed."""


def choices(*allowed: str, default: str) -> Any:
    """A string option restricted to ``allowed`` (checked by ``parse_options``)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(allowed)})


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if annotation in (float, "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"option {name!r} must be a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"option {name!r} must be a number, got {value!r}") from None
    if annotation in (int, "int"):
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"option {name!r} must be an integer, got {value!r}") from None
    if annotation in (bool, "bool"):
        if isinstance(value, str):
            lowered = value.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"option {name!r} must be true or false, got {value!r}")
        return bool(value)
    if origin is typing.Union and type(None) in typing.get_args(annotation):
        if value is None or value == "none":
            return None
        inner = [a for a in typing.get_args(annotation) if a is not type(None)][0]
        return _coerce(name, value, inner)
    return value


def parse_options(cls: type, values: Mapping[str, Any] | None, *, owner: str = "") -> Any:
    """Build dataclass ``cls`` from ``values``; unknown keys and bad values raise ``ConfigError``."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    prefix = f"{owner}: " if owner else ""
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}unknown option {unknown[0]!r}; allowed options: {sorted(fields)}")
    parsed = {}
    for name, value in values.items():
        field = fields[name]
        try:
            value = _coerce(name, value, hints[name])
        except ConfigError as err:
            raise ConfigError(f"{prefix}{err}") from None
        allowed = field.metadata.get("choices")
        if allowed and value not in allowed:
            raise ConfigError(f"{prefix}option {name!r} = {value!r} is not allowed; "
                              f"allowed values: {list(allowed)}")
        low = field.metadata.get("min")
        if low is not None and value is not None and value < low:
            raise ConfigError(f"{prefix}option {name!r} = {value!r} must be >= {low}")
        parsed[name] = value
    return cls(**parsed)


def positive(default: Any) -> Any:
    """A numeric option that must be > 0 (checked as >= smallest positive step)."""
    return dataclasses.field(default=default, metadata={"min": 1e-12 if isinstance(default, float) else 1})


def nonnegative(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"min": 0})


def describe_options(cls: type) -> list[str]:
    """One ``name=default [choices]`` line per option, for ``--help``."""
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        extra = f" {list(f.metadata['choices'])}" if "choices" in f.metadata else ""
        lines.append(f"{f.name}={default!r}{extra}")
    return lines


def parse_key_values(items: list[str] | None) -> dict[str, str]:
    """``['tau=0.05', 'variant=sys']`` -> dict; a malformed item raises ``ConfigError``."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"option {item!r} must look like key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out
