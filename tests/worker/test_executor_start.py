"""Executor processes are forked from the preloaded fork server (worker/launch.py; a CLI
worker forks it from itself): not fresh interpreters that import torch again; they still behave
as fresh ones did (torch threads, distinct numpy random numbers, the user's `__main__` left
alone) and die with their worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import torch_dataservice as tds
from tests.conftest import subprocess_env, wait_until
from torch_dataservice.pipeline import pickling
from torch_dataservice.pipeline.sharding import ReplicaPlan
from torch_dataservice.worker import launch
from torch_dataservice.worker.executor import ExecutorPool
from torch_dataservice.worker.messages import ReplicaKey, SplitRequest, TaskError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _torch_mapping(pid: int | str) -> str | None:
    """Where libtorch_cpu's first segment is mapped in process `pid` (None: not loaded)."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("libtorch_cpu.so"):
                return line.split("-", 1)[0]
    return None


def who_am_i(_: int) -> tuple[int, int, str | None]:
    return os.getpid(), os.getppid(), _torch_mapping("self")


def test_executors_are_forked_from_the_preloaded_fork_server(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=2)
    dataset = tds.Pipeline.range(4).map(who_am_i).apply(
        tds.distribute("parallel_epochs", cluster.target))
    seen = set(dataset)
    server = launch.shared_fork_server().pid
    assert server is not None and psutil.Process(server).ppid() == os.getpid()
    # Both workers' executors are children of this process's one fork server ...
    assert {pid for pid, _, _ in seen} and {ppid for _, ppid, _ in seen} == {server}
    assert len({pid for pid, _, _ in seen}) == 2
    # ... which imported torch before forking them: they run the fork server's mapping of
    # libtorch (address-space layout is randomized, so an interpreter that imported torch
    # itself would have it elsewhere).
    assert int(open("/proc/sys/kernel/randomize_va_space").read()) > 0
    assert {mapping for _, _, mapping in seen} == {_torch_mapping(server)} != {None}


def test_the_interpreter_start_method_remains(cluster_factory, monkeypatch) -> None:
    monkeypatch.setenv(launch.START_ENV, launch.INTERPRETER)
    cluster = cluster_factory(num_workers=1)
    dataset = tds.Pipeline.range(2).map(who_am_i).apply(
        tds.distribute("parallel_epochs", cluster.target))
    assert {ppid for _, ppid, _ in dataset} == {os.getpid()}  # a child of this process
    monkeypatch.setenv(launch.START_ENV, "bogus")
    with pytest.raises(ValueError, match="TORCH_DATASERVICE_EXECUTOR_START"):
        launch.start_method()


def numpy_draw(_: int) -> tuple[int, int]:
    import numpy as np

    return os.getpid(), int(np.random.randint(2**62))


def test_executors_draw_different_numpy_random_numbers(cluster_factory) -> None:
    # A fork copies the fork server's global generator: each executor must reseed it, as a
    # fresh interpreter would have seeded its own.
    cluster = cluster_factory(num_workers=2)
    dataset = tds.Pipeline.range(1).map(numpy_draw).apply(
        tds.distribute("parallel_epochs", cluster.target))
    draws = dict(dataset)
    assert len(draws) == 2 and len(set(draws.values())) == 2, draws


class _Listener:
    """Nothing arrives: the executors are never given work."""

    def on_element(self, key: ReplicaKey, split: object, offset: int, payload: object) -> None:
        pass

    def on_end(self, key: ReplicaKey) -> None:
        pass

    def on_error(self, key: ReplicaKey, error: TaskError) -> None:
        pass

    def on_get_split(self, request: SplitRequest) -> None:
        pass

    def on_blocked(self, key: ReplicaKey) -> None:
        pass

    def on_executor_lost(self, slot: int) -> None:
        pass

    def on_stages(self, slot: int, totals: tuple[float, ...]) -> None:
        pass


def test_start_fails_clearly_when_an_executor_dies_before_it_is_ready() -> None:
    pool = ExecutorPool(1, _Listener(), torch_threads=-1)  # torch refuses: it exits at once
    try:
        with pytest.raises(RuntimeError, match="executor 0 .* exited before it was ready"):
            pool.start(timeout=60)
    finally:
        pool.close()


def test_start_returns_with_every_executor_ready() -> None:
    pool = ExecutorPool(2, _Listener())
    try:
        pool.start(timeout=60)
        assert all(slot.ready.is_set() and slot.alive for slot in pool._slots)  # noqa: SLF001
    finally:
        pool.close()


@pytest.mark.parametrize("processes", [0, 1])
def test_close_ends_every_receive_loop_before_closing_its_connection(processes: int) -> None:
    # A receive loop left reading a closed descriptor read whatever reused its number next: a
    # worker restarted in this process lost its new executor's messages to the old loop and
    # hung (tests/integration/test_static_sharding.py, once in a full suite run).
    before = set(threading.enumerate())
    for _ in range(2):
        pool = ExecutorPool(processes, _Listener())
        pool.start(timeout=60)
        slots = list(pool._slots)  # noqa: SLF001
        pool.close()
        left = [t.name for t in set(threading.enumerate()) - before
                if t.name.startswith("executor-rx")]
        assert not left, f"receive loops outlived close: {left}"
        assert all(slot.conn.closed for slot in slots)


def slow(x: int) -> int:
    time.sleep(0.05)
    return x


@pytest.mark.slow
def test_executors_die_when_their_worker_process_is_sigkilled(process_cluster) -> None:
    process_cluster.start_dispatcher()
    worker = process_cluster.start_worker(processes=2)
    pipeline = tds.Pipeline.range(10_000).map(slow).apply(
        tds.distribute("parallel_epochs", process_cluster.target))
    elements = iter(pipeline)
    next(elements)  # the executors are busy in the map
    descendants = psutil.Process(worker.proc.pid).children(recursive=True)
    assert len(descendants) == 3, descendants  # the fork server and two executors
    # The CLI worker forked its fork server from itself before gRPC ran (one torch import, not
    # two): the fork server has libtorch where the worker has it (ASLR places an import of
    # its own elsewhere).
    (fork_server,) = psutil.Process(worker.proc.pid).children()
    assert _torch_mapping(fork_server.pid) == _torch_mapping(worker.proc.pid) is not None
    os.kill(worker.proc.pid, signal.SIGKILL)  # the worker alone, not its process group
    worker.proc.wait(timeout=10)

    def all_gone() -> bool:
        return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                       for p in descendants)

    wait_until(all_gone, 30, "the fork server and executors to exit", interval_s=0.1)
    del elements


MAIN_SCRIPT = """
    import os
    import torch_dataservice as tds

    # No `if __name__ == "__main__"` guard: executors must not run this file again.
    print("top level ran in", os.getpid(), flush=True)
    OFFSET = 100

    def shifted(x):
        return x + OFFSET

    dispatcher = tds.DispatchServer()
    worker = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, num_processes=2))
    pipeline = tds.Pipeline.range(6).map(shifted).map(lambda x: (x, os.getppid()))
    got = sorted(pipeline.apply(tds.distribute("parallel_epochs", dispatcher.target)))
    assert {ppid for _, ppid in got} != {os.getpid()}, got  # forked by the fork server
    print("got", [x for x, _ in got], flush=True)
    worker.stop()
    dispatcher.stop()
"""


def run_script(tmp_path, name: str, text: str) -> list[str]:
    """Run `text` as the script `name` in a fresh interpreter (default executor start); its
    output lines, once it exited 0."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(text))
    env = subprocess_env()
    env.pop(launch.START_ENV, None)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, cwd=str(tmp_path), timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_main_module_functions_run_in_forked_executors(tmp_path) -> None:
    lines = run_script(tmp_path, "train.py", MAIN_SCRIPT)
    assert len([line for line in lines if line.startswith("top level ran")]) == 1, lines
    assert lines[-1] == "got [100, 101, 102, 103, 104, 105]", lines


FORK_HERE_SCRIPT = """
    import os, threading
    from torch_dataservice.worker import launch

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    print("with a thread", launch.start_fork_server_here(), launch.shared_fork_server().pid)
    stop.set()
    other.join()
    print("alone", launch.start_fork_server_here(), launch.shared_fork_server().pid)
    print("me", os.getpid())
    # numpy's BLAS threads run, but no torch op did: its forks may run any torch threads
    print("threaded", launch.shared_fork_server().forked_with_threads)
"""

AFTER_GRPC_SCRIPT = """
    import grpc
    from torch_dataservice import rpc
    from torch_dataservice.worker import launch

    print("before grpc", launch.start_fork_server_here(), launch.shared_fork_server().pid is None)
    launch.shared_fork_server()._discard()
    channel = rpc.channel_to("localhost:1")  # a client's channel: gRPC's threads may run now
    try:
        grpc.channel_ready_future(channel).result(timeout=0.2)
    except grpc.FutureTimeoutError:
        pass
    print("after grpc", launch.start_fork_server_here(), launch.shared_fork_server().pid)
"""

# A training script: torch ops ran (torch's OpenMP pool runs), then an embedded DataLoader.
EMBEDDED_SCRIPT = """
    import torch
    import torch_dataservice as tds
    from torch_dataservice.worker import launch

    def squares(i):
        x = torch.full((64, 64), float(i))
        return int((x @ x)[0, 0].item()) // (64 * i) if i else 0  # == i

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return squares(i)

    torch.ones(512, 512) @ torch.ones(512, 512)
    loader = tds.DataLoader(Squares(), batch_size=4, num_workers=2)
    server = launch.shared_fork_server()
    print("forked", isinstance(server._popen, launch.ForkedServerProcess),
          server.forked_with_threads)
    print("read", sorted(int(x) for batch in loader for x in batch) == list(range(32)))
    # A worker wanting two torch threads per executor: not from that fork server.
    address = tds.torch.embedded.embedded_target().split("://")[1]
    worker = tds.WorkerServer(tds.WorkerConfig(address, num_processes=1,
                                               executor_torch_threads=2))
    kinds = {type(slot.process).__name__ for slot in worker._tasks._executors._slots}
    print("two threads", sorted(kinds))
    worker.stop()
"""


def test_a_fork_server_is_forked_from_its_front_only_while_it_runs_one_thread(tmp_path) -> None:
    lines = dict(line.rsplit(" ", 1)
                 for line in run_script(tmp_path, "fork_here.py", FORK_HERE_SCRIPT))
    assert lines["with a thread False"] == "None"  # left to be exec'd when first needed
    assert lines["alone True"] not in ("None", lines["me"])  # forked: a child of its own
    assert lines["threaded"] == "False"


def test_no_fork_server_is_forked_from_a_process_that_ran_grpc(tmp_path) -> None:
    # Whether gRPC's threads still run then is up to gRPC: what counts is the channel made.
    assert run_script(tmp_path, "after_grpc.py", AFTER_GRPC_SCRIPT) == [
        "before grpc True False", "after grpc False None"]


def test_an_embedded_loader_forks_its_fork_server_from_the_training_script(tmp_path) -> None:
    """Its first batch does not wait for a fresh interpreter to import torch. torch's OpenMP
    pool ran before the fork: executors on one torch thread are safe forks of it; one that
    wants two starts as a fresh interpreter (a fork would hang in its first parallel op)."""
    lines = run_script(tmp_path, "train.py", EMBEDDED_SCRIPT)
    assert lines == ["forked True True", "read True", "two threads ['InterpreterProcess']"]


class _SlowToNoticeLoss(_Listener):
    """Holds the executor's receive loop in `on_executor_lost` until released: the moment
    between an executor's death and its replacement."""

    def __init__(self) -> None:
        self.lost = threading.Event()
        self.release = threading.Event()

    def on_executor_lost(self, slot: int) -> None:
        self.lost.set()
        self.release.wait(30)


def test_a_replica_started_while_its_executor_restarts_goes_to_the_new_one() -> None:
    # Found in a full suite run (tests/worker/test_cache.py): the next epoch's task, started
    # right after an executor was SIGKILLed, failed with "executor process unavailable".
    listener = _SlowToNoticeLoss()
    pool = ExecutorPool(1, listener)
    try:
        pool.start(timeout=60)
        os.kill(pool._slots[0].process.pid, signal.SIGKILL)  # noqa: SLF001
        assert listener.lost.wait(30)
        threading.Timer(0.3, listener.release.set).start()
        started = pool.start_replica(
            0, (1, 0), "dataset", pipeline=lambda _: pickling.dumps(tds.Pipeline.range(3)),
            plan=ReplicaPlan(), compression=None, credits=1)
        assert started
        assert pool._slots[0].alive  # noqa: SLF001
    finally:
        listener.release.set()
        pool.close()


# A training script with many files open: the fork server's control socket is fd 1024 or more.
MANY_FILES_SCRIPT = """
    import os, resource
    import torch_dataservice as tds

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), max(hard, 2048)))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    print("many", min(held) < 1024 < max(held))
    loader = tds.DataLoader(list(range(16)), batch_size=4, num_workers=2)
    print("read", sorted(int(x) for batch in loader for x in batch) == list(range(16)))
"""


def test_a_fork_server_serves_a_process_with_over_a_thousand_files_open(tmp_path) -> None:
    # Found in a suite run: the fork server waited on its control socket with select(), which
    # refuses a descriptor of 1024 or more ("filedescriptor out of range"), and exited.
    assert run_script(tmp_path, "many_files.py", MANY_FILES_SCRIPT) == ["many True", "read True"]
