"""RemoteError: a remote exception arrives as its own type where this process has that type."""

from __future__ import annotations

import json
import pickle

import pytest

from torch_dataservice.errors import RemoteError


class DatasetCorrupt(Exception):
    """A user's own exception class, found in this module by its qualified name."""


class NeedsArguments(Exception):
    def __new__(cls, code: int) -> NeedsArguments:  # cannot be made without its argument
        return super().__new__(cls, code)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("remote_type, expected", [
    ("builtins.KeyError", KeyError),
    ("builtins.ValueError", ValueError),
    ("builtins.FileNotFoundError", FileNotFoundError),
    ("json.decoder.JSONDecodeError", json.JSONDecodeError),
    (f"{__name__}.DatasetCorrupt", DatasetCorrupt),
])
def test_a_known_remote_type_is_caught_as_itself(remote_type: str, expected: type) -> None:
    with pytest.raises(expected) as info:
        raise RemoteError(remote_type, "sample 7 is corrupt", "Traceback (most recent call last)")
    error = info.value
    assert isinstance(error, RemoteError)
    assert error.remote_type == remote_type and error.remote_message == "sample 7 is corrupt"
    assert "sample 7 is corrupt" in str(error) and "Remote traceback" in str(error)
    assert type(pickle.loads(pickle.dumps(error))) is type(error)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("remote_type", [
    "no_such_module.Error",            # not importable here
    f"{__name__}.NoSuchClass",         # module known, class not
    f"{__name__}.NeedsArguments",      # a __new__ that needs arguments
    "builtins.StopIteration",          # would end the reader's iteration silently
    "builtins.int",                    # not an exception
])
def test_an_unknown_or_unsafe_remote_type_stays_a_plain_remote_error(remote_type: str) -> None:
    error = RemoteError(remote_type, "message", "")
    assert type(error) is RemoteError
    assert str(error) == f"{remote_type}: message"
