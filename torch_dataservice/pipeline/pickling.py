"""Pickling what the workers run, with an error that says which attribute cannot travel.

cloudpickle's own error names a type (`cannot pickle '_thread.lock' object`), not where it
sits: in a dataset holding a reader holding a pool holding a lock, the user has to search.
On failure `dumps` walks the object (attributes, items, a bound method's object, a
function's closure, defaults and globals, a partial's arguments), pickling each part alone,
down to the first part that fails while all of its own parts pickle, and raises naming its
path and type, e.g. `dataset.reader._pool.lock (_thread.lock)`, with cloudpickle's error chained.
"""

from __future__ import annotations

import functools
import pickle
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle


def dumps(obj: Any, name: str = "") -> bytes:
    """`cloudpickle.dumps(obj)`; on failure an error of the same type naming the path (from
    `name`; an empty name starts the paths at `obj`'s attributes or keys) of the first part of
    `obj` that cannot be pickled."""
    try:
        return cloudpickle.dumps(obj)
    except Exception as error:
        path, culprit = _first_unpicklable(obj, name, set())
        message = (f"{path or name or 'the object'} ({_type_name(culprit)}) cannot be pickled, "
                   f"so it cannot travel to the service's workers: {error}. Make it picklable "
                   "(or create it lazily on the worker, or leave it out in __getstate__).")
        try:
            raised = type(error)(message)
        except Exception:  # an exception type that takes other arguments
            raised = pickle.PicklingError(message)
        raise raised from error


def _pickles(obj: Any) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True


def _first_unpicklable(obj: Any, path: str, seen: set[int]) -> tuple[str, Any]:
    """The path and object of the first part of `obj` (which does not pickle) whose parts
    all pickle; `obj` itself when none of its parts fails alone."""
    seen.add(id(obj))
    for child_path, child in _parts(obj, path):
        if id(child) not in seen and not _pickles(child):
            return _first_unpicklable(child, child_path, seen)
    return path, obj


def _parts(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    """What pickling `obj` pickles in turn, each with its path."""
    def attribute(name: str) -> str:
        return f"{path}.{name}" if path else name

    if isinstance(obj, dict):
        for key, value in obj.items():
            yield (attribute(key) if not path and isinstance(key, str)
                   else f"{path}[{key!r}]"), value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
    elif isinstance(obj, types.MethodType):
        yield attribute("__self__"), obj.__self__
        yield attribute("__func__"), obj.__func__
    elif isinstance(obj, functools.partial):
        yield attribute("func"), obj.func
        for index, value in enumerate(obj.args):
            yield f"{path}.args[{index}]", value
        for key, value in obj.keywords.items():
            yield f"{path}.keywords[{key!r}]", value
    elif isinstance(obj, types.FunctionType):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
            try:
                yield attribute(name), cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for index, value in enumerate(obj.__defaults__ or ()):
            yield f"{path}.__defaults__[{index}]", value
        for name in obj.__code__.co_names:  # globals it uses (by value from `__main__`)
            if name in obj.__globals__:
                yield f"{path}.__globals__[{name!r}]", obj.__globals__[name]
    else:
        state = _state(obj)
        if isinstance(state, dict):
            for key, value in state.items():
                yield (attribute(key) if isinstance(key, str) else f"{path}[{key!r}]"), value


def _state(obj: Any) -> Any:
    """What pickle saves of an object's state: its `__getstate__()` (or `__dict__`), with
    `__slots__` values."""
    try:
        state = obj.__getstate__()
    except Exception:
        state = getattr(obj, "__dict__", None)
    if isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
        merged = dict(state[0] or {})
        merged.update(state[1] or {})
        return merged
    return state


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
