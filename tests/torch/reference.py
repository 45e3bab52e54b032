"""torch's own results, computed in a fresh interpreter.

A process where our gRPC ran must not fork torch's DataLoader workers (gRPC is not fork-safe:
the child can crash), and a reference computed beside our loaders could also see state they
left (the global RNG). So the reference runs as a script in a new Python, which imports the
datasets from the test module, and prints its result as JSON on its last line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from tests.conftest import REPO, subprocess_env


def torch_result(code: str, timeout_s: float = 120) -> Any:
    """Run `code` (dedented) in a fresh interpreter; its last line of output, parsed as JSON."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, env=subprocess_env(), cwd=str(REPO), timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
