"""The embedded service (torch/embedded.py) leaves a training script as fit to fork as torch's
DataLoader does (issue 24.1): after a `tds.DataLoader` epoch, and while a loader is alive, the
script runs torch's DataLoader with forked workers, a multiprocessing fork pool, a subprocess
and more `tds.DataLoader` epochs, and nothing is printed (gRPC said "skipping fork()
handlers" and torch's workers died of SIGSEGV when the servers ran in the script's process).
Each case is a real script in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import subprocess_env, wait_until
from torch_dataservice.torch import embedded
from torch_dataservice.worker import launch

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(150)]

SCRIPT = """
    import multiprocessing, subprocess, sys
    import torch
    import torch_dataservice as tds
    from torch.utils.data import DataLoader, Dataset

    class Numbers(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return torch.tensor([i])

    def square(x):
        return x * x

    def total(loader):
        return sum(int(batch.sum()) for batch in loader)

    if __name__ == "__main__":
        mode = sys.argv[1]
        want = sum(range(64))
        loader = tds.DataLoader(Numbers(), batch_size=8, num_workers=2,
                                persistent_workers=mode == "persistent")
        assert total(loader) == want
        live = None
        if mode != "finished":  # an epoch under way (its reader heartbeats) at every fork
            live = iter(loader)
            next(live)
        for _ in range(3):
            assert total(DataLoader(Numbers(), batch_size=8, num_workers=2)) == want
            assert total(DataLoader(Numbers(), batch_size=8, num_workers=2,
                                    persistent_workers=True)) == want
            with multiprocessing.get_context("fork").Pool(2) as pool:
                assert pool.map(square, range(10)) == [x * x for x in range(10)]
            assert subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True,
                                  text=True, check=True).stdout == "7\\n"
        if live is not None:
            assert sum(1 for _ in live) == 7
        assert total(loader) == want
        assert total(tds.DataLoader(Numbers(), batch_size=8, num_workers=2)) == want
        print("ok")
"""


def run(tmp_path, text: str, *args: str, start: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(text))
    env = subprocess_env()
    env.pop(embedded.ADDRESS_ENV, None)  # the embedded service
    env.pop(launch.START_ENV, None)
    if start is not None:
        env[launch.START_ENV] = start
    return subprocess.run([sys.executable, str(script), *args], capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=timeout)


@pytest.mark.parametrize("mode", ["finished", "live", "persistent"])
def test_a_script_forks_after_and_during_an_epoch_and_nothing_is_printed(tmp_path,
                                                                         mode: str) -> None:
    """finished: the loader's epoch ended (the loader itself is still referenced); live: an
    iterator is mid-epoch at every fork; persistent: the same with persistent_workers=True."""
    result = run(tmp_path, SCRIPT, mode)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert result.stderr == ""  # no "skipping fork() handlers", no worker's SIGSEGV


KILLED_SCRIPT = """
    import os, signal, time
    import torch
    import torch_dataservice as tds
    from torch_dataservice.torch import embedded

    if __name__ == "__main__":
        loader = tds.DataLoader(list(range(16)), batch_size=4)
        assert sum(len(batch) for batch in loader) == 16
        child = os.fork()
        if child == 0:  # outlives its parent, holding what it inherited (not our output)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 1)
            os.dup2(null, 2)
            time.sleep(60)
            os._exit(0)
        print(embedded._service.process.pid, child, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_service_stops_when_its_script_is_killed_even_if_a_fork_lives_on(tmp_path) -> None:
    """A fresh interpreter (no fork server to kill it as an orphan): it stops because the
    connection closed, which a fork of the script must not hold open."""
    # run() returns once every holder of the script's stderr exited.
    result = run(tmp_path, KILLED_SCRIPT, start=launch.INTERPRETER)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    service, child = (int(pid) for pid in result.stdout.split())
    try:
        wait_until(lambda: not _alive(service), 30, f"the embedded service (pid {service}) "
                   "to stop")
        assert _alive(child)  # it kept the service alive before: its copy of the connection
    finally:
        for pid in (service, child):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


RESTART_SCRIPT = """
    import os, signal, time
    import torch
    import torch_dataservice as tds
    from torch_dataservice.torch import embedded

    if __name__ == "__main__":
        loader = tds.DataLoader(list(range(16)), batch_size=4, num_workers=2)
        assert sum(len(batch) for batch in loader) == 16
        killed = embedded._service.process
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(30)
        assert sum(len(batch) for batch in loader) == 16
        assert embedded._service.process.pid != killed.pid
        print("ok")
"""


def test_a_killed_service_is_started_again_for_the_next_epoch(tmp_path) -> None:
    result = run(tmp_path, RESTART_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert "exited; starting another" in result.stderr


EARLY_SCRIPT = """
    import torch
    import torch_dataservice as tds
    from torch_dataservice.torch import embedded

    if __name__ == "__main__":
        loader = tds.DataLoader(list(range(16)), batch_size=4, num_workers=2)
        service = embedded._service
        assert service is not None, "no service started when the loader was built"
        assert service.target is None  # not waited for: the script goes on meanwhile
        assert sum(len(batch) for batch in loader) == 16
        assert embedded._service is service and service.target is not None
        print("ok")
"""


def test_the_service_starts_when_the_first_loader_is_built_and_is_waited_for_at_its_use(
        tmp_path) -> None:
    """Its start (a few hundred milliseconds) overlaps the script's work before the first
    epoch, instead of delaying the first batch; the first epoch reads from that service."""
    result = run(tmp_path, EARLY_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
    assert result.stderr == ""
