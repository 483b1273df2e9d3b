"""The one options mechanism: typed option dataclasses, their checks, and their flags.

Every method, job and service declares its options as a dataclass.

- ``parse_options`` turns a plain dict (from JSON, ``--opt key=value`` or the command line)
  into it, or raises ``ConfigError`` naming the key and what is allowed, before any torch
  code runs.
- ``add_options`` turns the same dataclass into argparse flags (``train_classes`` ->
  ``--train-classes``; a nested dataclass field adds its own fields' flags), and
  ``options_from_args`` turns the parsed flags back into the dataclass through
  ``parse_options``, so the command line gets exactly the checks a dict gets.
- Field helpers: ``option`` (help text, flag name), ``choices``, ``positive``,
  ``nonnegative``, ``fraction``. A float option is always a finite number (``inf`` and
  ``nan`` are refused).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what is allowed."""


def choices(*allowed: str, default: str, help: str = "") -> Any:
    """A string option restricted to ``allowed`` (checked by ``parse_options``)."""
    return dataclasses.field(default=default, metadata={"choices": tuple(allowed), "help": help})


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if annotation in (float, "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"option {name!r} must be a number, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"option {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"option {name!r} must be a finite number, got {value!r}")
        return number
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
    if _is_optional(annotation):
        if value is None or value == "none":
            return None
        inner = [a for a in typing.get_args(annotation) if a is not type(None)][0]
        return _coerce(name, value, inner)
    if annotation is tuple or origin is tuple:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if isinstance(value, (list, tuple)):
            return tuple(value)
        raise ConfigError(f"option {name!r} must be a comma-separated list, got {value!r}")
    return value


def _is_optional(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    union = origin is typing.Union or (origin is not None and origin.__name__ == "UnionType")
    return union and type(None) in typing.get_args(annotation)


def parse_options(
    cls: type, values: Mapping[str, Any] | None, *, owner: str = "", base: Any = None
) -> Any:
    """Build dataclass ``cls`` from ``values``; unknown keys and bad values raise ``ConfigError``.

    Keys absent from ``values`` keep the defaults of ``base`` (an instance of ``cls``) or of
    the class. A field whose type is itself a dataclass takes a nested mapping, applied to
    that field's default the same way.
    """
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    prefix = f"{owner}: " if owner else ""
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"{prefix}unknown option {unknown[0]!r}; allowed options: {sorted(fields)}"
        )
    parsed = {}
    for name, value in values.items():
        field = fields[name]
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, Mapping):
            inner_base = getattr(base, name) if base is not None else _default(field)
            parsed[name] = parse_options(hints[name], value, owner=owner, base=inner_base)
            continue
        try:
            value = _coerce(name, value, hints[name])
        except ConfigError as err:
            raise ConfigError(f"{prefix}{err}") from None
        allowed = field.metadata.get("choices")
        if allowed and value not in allowed:
            raise ConfigError(
                f"{prefix}option {name!r} = {value!r} is not allowed; "
                f"allowed values: {list(allowed)}"
            )
        low = field.metadata.get("min")
        if low is not None and value is not None and value < low:
            raise ConfigError(f"{prefix}option {name!r} = {value!r} must be >= {low}")
        high = field.metadata.get("max")
        if high is not None and value is not None and value > high:
            raise ConfigError(
                f"{prefix}option {name!r} = {value!r} must be <= {high}"
                + (_fraction_hint(value) if field.metadata.get("fraction") else "")
            )
        parsed[name] = value
    if base is not None:
        return dataclasses.replace(base, **parsed)
    return cls(**parsed)


def _fraction_hint(value: float) -> str:
    """For a percent typed where a fraction is meant: ``30`` -> ``: a fraction, 0.3 for 30 %``."""
    example = value if value <= 100 else 30.0
    return f": a fraction, {example / 100:g} for {example:g} %"


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def option(
    default: Any = None,
    *,
    help: str = "",
    flag: str | None = None,
    factory: Any = None,
    **metadata: Any,
) -> Any:
    """A dataclass field with its ``--help`` text and, optionally, its own flag name
    (``flag="--pretrained"``) or a default ``factory``; other metadata (``choices``, ``min``,
    ``max``) is checked by ``parse_options``."""
    meta = dict(metadata, help=help)
    if flag:
        meta["flag"] = flag
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def positive(default: Any, help: str = "") -> Any:
    """A numeric option that must be > 0 (checked as >= smallest positive step)."""
    low = 1e-12 if isinstance(default, float) else 1
    return dataclasses.field(default=default, metadata={"min": low, "help": help})


def nonnegative(default: Any, help: str = "") -> Any:
    """A numeric option that must be >= 0."""
    return dataclasses.field(default=default, metadata={"min": 0, "help": help})


def fraction(default: Any = None, help: str = "") -> Any:
    """A numeric option in [0, 1]; a value above 1 (a percent typed for a fraction) is refused
    with the fraction it may have meant."""
    return dataclasses.field(
        default=default, metadata={"min": 0, "max": 1, "fraction": True, "help": help}
    )


def describe_options(cls: type) -> list[str]:
    """One ``name=default [choices]`` line per option, for ``--help``."""
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
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


# -- dataclass <-> argparse -----------------------------------------------------------------
def make_parser(
    job: str | None = None, description: str | None = None, **kw: Any
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for job ``job`` that never accepts an abbreviated flag: ``--train``
    is an error, not a silent ``--train-classes``. Its usage line names the job as it was
    started: the script (``train_ract.py``) or ``raycompat <job>``."""
    kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = script if script.endswith(".py") or not job else f"raycompat {job}"
    return argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False, **kw)


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def add_options(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    base: Any = None,
    exclude: tuple[str, ...] = (),
    title: str | None = None,
    _prefix: str = "",
) -> None:
    """One flag per field of dataclass ``cls`` (nested dataclass fields add their fields'
    flags in a group of their own). Flags store strings; :func:`options_from_args` checks and
    converts them. ``base`` (an instance) supplies the defaults shown in ``--help``."""
    base = base if base is not None else cls()
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title) if title else parser
    for field in dataclasses.fields(cls):
        if field.name in exclude or not field.init:
            continue
        default = getattr(base, field.name)
        if dataclasses.is_dataclass(hints[field.name]):
            add_options(
                parser,
                hints[field.name],
                base=default,
                exclude=exclude,
                title=f"{field.name.replace('_', ' ')}",
                _prefix=f"{_prefix}{field.name}.",
            )
            continue
        helptext = field.metadata.get("help", "")
        if "choices" in field.metadata:
            helptext = f"{helptext} {list(field.metadata['choices'])}".strip()
        shown = ",".join(default) if isinstance(default, tuple) else default
        kwargs: dict[str, Any] = dict(
            dest=_prefix + field.name,
            default=argparse.SUPPRESS,
            help=f"{helptext} (default: {shown})".strip(),
        )
        if hints[field.name] is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = field.name.upper()
        group.add_argument(_flag(field), **kwargs)


def options_from_args(
    cls: type, args: argparse.Namespace | Mapping[str, Any], *, owner: str = "", base: Any = None
) -> Any:
    """The dataclass ``cls`` from the flags :func:`add_options` added (only the flags given on
    the command line; the others keep their defaults). Bad values raise ``ConfigError``."""
    given = dict(vars(args) if isinstance(args, argparse.Namespace) else args)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for dest, value in given.items():
        *path, name = dest.split(".")
        if (path[0] if path else name) not in names:
            continue
        inner = values
        for part in path:  # a nested dataclass, at any depth: a nested mapping
            inner = inner.setdefault(part, {})
        inner[name] = value
    return parse_options(cls, values, owner=owner, base=base)
