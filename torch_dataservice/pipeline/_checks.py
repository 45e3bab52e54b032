"""Argument validation shared by sources and transforms: errors name the offending value."""

from __future__ import annotations

import operator
from typing import Any


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return `value` as an int, or raise ValueError naming it (bools are not ints here)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return number


def check_optional_int(name: str, value: Any, *, minimum: int | None = None) -> int | None:
    return None if value is None else check_int(name, value, minimum=minimum)


def check_callable(name: str, fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"{name} must be callable, got {fn!r}")


def callable_name(fn: Any) -> str:
    """Short human name of a user function, for reprs."""
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
