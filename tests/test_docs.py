"""Every code block of README.md and docs/*.md runs (the rule is in docs/development.md):

- ```python blocks run, each alone, in a fresh interpreter in an empty directory;
- ```bash blocks run with `bash -euo pipefail` in the repository (cheap, leaving nothing);
- ```console blocks are commands to type elsewhere (a fleet, a container, torchrun): they do
  not run, and the line before each says why, as `<!-- not run: REASON -->`;
- ```promql and ```text blocks are not programs;
- a fence without one of these languages fails, so that every block is decided.
Each must exit 0 within DEADLINE_S.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, subprocess_env

DEADLINE_S = 120
RUN = {"python", "bash"}
NOT_RUN = {"console", "promql", "text"}
FENCE = re.compile(r"^([ \t]*)```(\S*)\n(.*?)^\1```$", re.MULTILINE | re.DOTALL)
NOT_RUN_MARK = re.compile(r"<!-- not run: \S.* -->")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks() -> list[tuple[str, str, str, str]]:
    """(id, language, code, the line before the fence) of every fenced block."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            found.append((f"{page.relative_to(REPO)}:{line}", match.group(2),
                          textwrap.dedent(match.group(3)), before))
    return found


BLOCKS = blocks()


@pytest.mark.timeout(10)
def test_every_block_is_run_or_says_why_not() -> None:
    assert len(PAGES) >= 7, PAGES  # the README and the six pages of docs/
    for where, language, _, before in BLOCKS:
        assert language in RUN | NOT_RUN, f"{where}: a ```{language} block: run or mark it"
        if language == "console":
            assert NOT_RUN_MARK.fullmatch(before.strip()), (
                f"{where}: a console block needs '<!-- not run: REASON -->' on the line before")


@pytest.mark.timeout(10)
def test_the_readme_stays_short_and_links_every_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, page.name


@pytest.mark.integration
@pytest.mark.slow  # each a fresh interpreter, many an embedded service
@pytest.mark.timeout(DEADLINE_S + 30)
@pytest.mark.parametrize("language,code", [
    pytest.param(language, code, id=where) for where, language, code, _ in BLOCKS
    if language in RUN])
def test_the_block_runs(language: str, code: str, tmp_path: Path) -> None:
    env = subprocess_env()
    env.pop("TORCH_DATASERVICE_ADDRESS", None)  # the DataLoader snippets embed their service
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if language == "python":
        command, cwd = [sys.executable, "-c", code], tmp_path
    else:
        command, cwd = ["bash", "-euo", "pipefail", "-c", code], REPO
    try:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=DEADLINE_S, start_new_session=True)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"did not finish within {DEADLINE_S}s:\n{error.stdout}\n{error.stderr}")
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
