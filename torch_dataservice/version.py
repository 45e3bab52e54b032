"""What this build is, and whether two builds can work together.

Three numbers travel with every registration (worker -> dispatcher, client -> dispatcher):
the package version (for logs and for people), the wire protocol version (bumped whenever
the messages, the element encoding or the pipeline classes that cross the wire change
incompatibly) and the Python ``major.minor`` (cloudpickle only moves code between the same
Python version). The dispatcher refuses a peer whose protocol or Python differ from its own,
so a mismatch fails at registration with both sides named, not later with an unpickling error
inside a worker.

Test-only: ``TORCH_DATASERVICE_TEST_PROTOCOL_VERSION`` and
``TORCH_DATASERVICE_TEST_PYTHON_VERSION`` override the versions this process reports, so
tests can simulate an incompatible peer. Never set them in production.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

from torch_dataservice.proto import common_pb2

PACKAGE_VERSION = "0.1.0"  # the same as pyproject.toml and torch_dataservice.__version__
PROTOCOL_VERSION = 1

TEST_PROTOCOL_ENV = "TORCH_DATASERVICE_TEST_PROTOCOL_VERSION"
TEST_PYTHON_ENV = "TORCH_DATASERVICE_TEST_PYTHON_VERSION"


@dataclass(frozen=True)
class BuildInfo:
    """The versions a process reports at registration."""

    package: str
    protocol: int
    python: str  # "major.minor"

    def describe(self) -> str:
        return f"torch_dataservice {self.package} (protocol {self.protocol}, Python {self.python})"

    def incompatibility(self, other: BuildInfo) -> str | None:
        """Why `other` cannot work with this build (None: it can)."""
        if other.protocol != self.protocol:
            return "wire protocol versions differ"
        if other.python != self.python:
            return "Python major.minor versions differ (cloudpickle needs the same)"
        return None


def current() -> BuildInfo:
    """This process's build (honouring the test-only overrides of the module docstring)."""
    protocol_text = os.environ.get(TEST_PROTOCOL_ENV)
    try:
        protocol = int(protocol_text) if protocol_text else PROTOCOL_VERSION
    except ValueError:
        raise ValueError(f"{TEST_PROTOCOL_ENV} must be an integer, got {protocol_text!r}") from None
    python = os.environ.get(TEST_PYTHON_ENV) or f"{sys.version_info[0]}.{sys.version_info[1]}"
    return BuildInfo(PACKAGE_VERSION, protocol, python)


def to_message(build: BuildInfo) -> common_pb2.BuildInfo:
    return common_pb2.BuildInfo(package_version=build.package, protocol_version=build.protocol,
                                python_version=build.python)


def from_message(message: common_pb2.BuildInfo) -> BuildInfo:
    return BuildInfo(message.package_version, message.protocol_version, message.python_version)


def version_text() -> str:
    """What `torch-dataservice --version` prints."""
    build = current()
    return (f"torch-dataservice {build.package} (wire protocol {build.protocol}, "
            f"{platform.python_implementation()} {platform.python_version()})")
