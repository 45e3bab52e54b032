"""How executor processes start: forked from a preloaded fork server, or as fresh interpreters.

A fresh interpreter importing torch takes seconds (tens of seconds when several start at once on
a busy host) and holds ~150 MB of its own. So each front process keeps one fork server: a
`python -c` interpreter that imports torch, numpy and this package once, then forks an executor
per request. A fork costs milliseconds, and the imported code and data stay pages shared with
the fork server (copy-on-write). Like the fresh interpreters before it, the fork server never
re-imports the user's `__main__` (a script without an `if __name__ == "__main__"` guard still
works) and never inherits gRPC's threads (it is exec'd, not forked, from the front).

Why not `multiprocessing.get_context("forkserver")`: its children re-run the user's `__main__`
(as `__mp_main__`, like "spawn"), so an unguarded training script would start its servers again
in every executor; its fork server is one per process, shared with the user's own
multiprocessing, so our preload list could come after it started; and it has no way to hand over
the executor's socket and standard streams as they are when each executor starts.

Each executor is handed, like a subprocess, the front's current `sys.path`, working directory,
environment and stdout/stderr. What is read only when a process starts or imports (MALLOC_*,
OMP_NUM_THREADS at torch's import) comes from the environment the fork server started with: the
front's at its first worker. Executors draw fresh numpy random numbers (a fork would otherwise
copy the fork server's global generator into every executor; Python's `random` reseeds itself).
The fork server stays for the front's next worker; it exits when the front does.

It forks one other kind of process (`start_process`): a training script's embedded service
(torch/embedded.py), which runs gRPC servers out of the script's process and forks a fork
server of its own, before it starts them, for its worker's executors.

A process that has imported all of that, runs one thread and has started no gRPC server or
channel yet (the `torch-dataservice worker` command, before it builds its server; a training
script when its first embedded DataLoader is built) starts its fork server as a fork of
itself instead (`start_fork_server_here`): a worker then imports torch once, not twice, and
an embedded DataLoader's first batch does not wait for a fresh interpreter to import torch.
That fork is safe only before gRPC runs: once gRPC has threads, its own fork handlers
restart them in the child (seen: the child aborts in gRPC's poller), so a fork server started
any later is exec'd as above. A script may have run torch ops before (its OpenMP pool hangs a
forked child's parallel ops on more than one thread): executors that want more than one torch
thread then start as fresh interpreters.

`TORCH_DATASERVICE_EXECUTOR_START=interpreter` starts fresh interpreters instead (also the
fallback where fork or pidfds are missing): the way to tell whether a problem comes from forking.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import pickle
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from torch_dataservice import rpc

START_ENV = "TORCH_DATASERVICE_EXECUTOR_START"
FORKSERVER, INTERPRETER = "forkserver", "interpreter"
# What the fork server imports before its first fork (missing optional ones are skipped).
PRELOAD = ("numpy", "numpy.random", "torch", "torch_dataservice.worker.executor_process")
# The fork server's first answer waits for its imports: seconds, minutes on an overloaded host.
FORK_TIMEOUT_S = 300.0
# After the front is gone, executors (who see their connection close) get this long to exit.
ORPHAN_GRACE_S = 10.0

_HEADER = struct.Struct("!I")  # request length, sent with the request's file descriptors
_REPLY = struct.Struct("!i")  # the executor's pid (0: the fork failed), sent with its pidfd

# What an executor process runs, as `run_main` runs any: `main(Connection(conn_fd), **kwargs)`.
EXECUTOR_MAIN = "torch_dataservice.worker.executor_process:executor_main"

_INTERPRETER_BOOT = (
    "import sys\n"
    # The parent's import path (as multiprocessing's spawn does): its modules import here too.
    "sys.path[:0] = sys.argv[4:]\n"
    "import json\n"
    "from multiprocessing.connection import Connection\n"
    "from torch_dataservice.worker.launch import run_main\n"
    "run_main(Connection(int(sys.argv[1])), sys.argv[2], json.loads(sys.argv[3]))\n"
    # Skip interpreter teardown: with torch loaded it takes seconds, and a worker waits for it.
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "import os; os._exit(0)\n"
)

_FORK_SERVER_BOOT = (
    "import sys\n"
    "sys.path[:0] = sys.argv[2:]\n"
    "from torch_dataservice.worker.launch import serve\n"
    "serve(int(sys.argv[1]))\n"
)


class ExecutorProcess(Protocol):
    """What the front needs of an executor process, however it started."""

    pid: int

    def wait(self, timeout: float) -> bool:
        """True once the process exited (False: still running after `timeout`)."""
        ...

    def kill(self) -> None: ...


def start_method() -> str:
    """FORKSERVER unless the environment asks for fresh interpreters or the OS lacks pidfds."""
    wanted = os.environ.get(START_ENV, FORKSERVER).strip().lower() or FORKSERVER
    if wanted not in (FORKSERVER, INTERPRETER):
        raise ValueError(f"{START_ENV} must be {FORKSERVER!r} or {INTERPRETER!r}, got {wanted!r}")
    if wanted == FORKSERVER and not (hasattr(os, "fork") and hasattr(os, "pidfd_open")):
        return INTERPRETER
    return wanted


def start_fork_server_here(after_torch_ops: bool = False, inherited_pool: bool = False) -> bool:
    """Fork this process's fork server from this process, now (module docstring), if no other
    thread of ours or gRPC's runs: call it before this process starts any gRPC server or
    channel. Where one may run nothing happens and the fork server is exec'd later, as in any
    other process: a Python thread (our servers and clients run threads; so does pytest's
    timeout), a gRPC channel or server of ours made before (rpc.grpc_started), or threads of
    another library's gRPC while they run (they have names; the BLAS and OpenMP pools of
    numpy and torch do not). A process that initialized CUDA is not forked either.
    `after_torch_ops`: this process may have run torch ops (a training script), so torch's
    OpenMP pool may be among its threads (see start_executor); `inherited_pool`: this process
    is a fork of one whose fork server was (it may carry that pool's state, not its threads).
    True if it forked it."""
    if (start_method() != FORKSERVER or threading.active_count() > 1
            or threading.current_thread() is not threading.main_thread()
            or rpc.grpc_started() or _named_threads() or _cuda_initialized()):
        return False
    shared_fork_server().boot_here(
        threaded=inherited_pool or (after_torch_ops and _native_threads() > 1))
    return True


def _native_threads() -> int:
    """Threads of this process, Python's or not (1 where /proc does not tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _named_threads() -> list[str]:
    """Names of this process's threads that differ from the process's own (gRPC's)."""
    def name(task: str) -> str:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()

    try:
        own = name(str(os.getpid()))
        names = [name(task) for task in os.listdir("/proc/self/task")]
    except OSError:
        return []
    return [n for n in names if n != own]


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # a torch without CUDA support, or half-imported: nothing to protect
        return False


def start_executor(conn_fd: int, torch_threads: int | None,
                   cache_dir: str | None = None) -> ExecutorProcess:
    """Start an executor process serving the connection `conn_fd` (the caller closes it);
    `cache_dir`: where its `cache()` steps keep entries by default (the worker's)."""
    # A fork server forked from a process with threads may carry torch's OpenMP pool: its
    # forks hang in a parallel op on more than one thread (one is safe, as for torch's own
    # forked DataLoader workers).
    fresh = torch_threads != 1 and shared_fork_server().forked_with_threads
    return start_process(conn_fd, EXECUTOR_MAIN,
                         {"torch_threads": torch_threads, "cache_dir": cache_dir}, fresh=fresh)


def start_process(conn_fd: int, main: str, kwargs: dict, *, fresh: bool = False
                  ) -> ExecutorProcess:
    """Start a process running `main` ("module:function") as
    `function(Connection(conn_fd), **kwargs)` (JSON-able kwargs), forked from the fork
    server, or as a fresh interpreter (`fresh`, or the start method says so): an executor,
    or the embedded service (torch/embedded.py). The caller closes `conn_fd`."""
    if fresh or start_method() == INTERPRETER:
        return InterpreterProcess(conn_fd, main, kwargs)
    return shared_fork_server().fork(conn_fd, main, kwargs)


def run_main(conn: Connection, main: str, kwargs: dict) -> None:
    """In a started process: `main(conn, **kwargs)`."""
    module, _, name = main.partition(":")
    getattr(importlib.import_module(module), name)(conn, **kwargs)


# ====================================================================== fresh interpreters
class InterpreterProcess:
    """A process as a fresh interpreter (`python -c`): the start method before the fork
    server, kept as the fallback."""

    def __init__(self, conn_fd: int, main: str, kwargs: dict) -> None:
        self._popen = subprocess.Popen(
            [sys.executable, "-c", _INTERPRETER_BOOT, str(conn_fd), main, json.dumps(kwargs),
             *sys.path],
            pass_fds=(conn_fd,), stdin=subprocess.DEVNULL)
        self.pid = self._popen.pid

    def wait(self, timeout: float) -> bool:
        try:
            self._popen.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        self._popen.kill()


# ====================================================================== the fork server
@dataclass
class _Request:
    """Sent with each fork: what the child runs (`run_main`), and what a subprocess would
    inherit from the front at that moment."""

    main: str
    kwargs: dict
    sys_path: list[str]
    cwd: str
    environ: dict[str, str]


class ForkedProcess:
    """An executor forked by the fork server: not our child, so it is watched and signalled
    through its pidfd (which, unlike a pid, can never name a later process)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._lock = threading.Lock()

    def wait(self, timeout: float) -> bool:
        with self._lock:
            if self._pidfd < 0:
                return True
            poller = select.poll()  # not select(): a busy front's fds may pass 1023
            poller.register(self._pidfd, select.POLLIN)
            if not poller.poll(int(timeout * 1000)):
                return False
            os.close(self._pidfd)  # it exited: the pidfd is of no more use
            self._pidfd = -1
            return True

    def kill(self) -> None:
        with self._lock:
            if self._pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __del__(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)


class ForkedServerProcess:
    """A fork server forked from this process (`start_fork_server_here`), watched as the
    subprocess.Popen of an exec'd one is."""

    def __init__(self, control: socket.socket, peer: socket.socket) -> None:
        for module in PRELOAD:  # imported here, before the fork: the child imports nothing
            try:
                __import__(module)
            except ImportError:
                if module == PRELOAD[-1]:
                    raise
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                _leave_the_parent(control.fileno(), peer.fileno())
                serve(control.fileno())
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else's waitpid(-1)
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # unreaped: the pid is still its own
            except ProcessLookupError:
                pass


def _leave_the_parent(control_fd: int, peer_fd: int) -> None:
    """In a fork server just forked from its front: drop what belongs to the front."""
    for signum in signal.valid_signals():  # the front's Python handlers (a drain on TERM)
        try:
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    null = os.open(os.devnull, os.O_RDWR)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd in (1, 2, control_fd, null):
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue  # the listing's own descriptor, closed since
        # The front's end of the control socket must go (else the fork server would never
        # see it close), and so must any other socket or pipe; /dev/null takes their numbers
        # so that no later descriptor reuses one a Python object still names.
        if fd in (0, peer_fd) or not stat.S_ISREG(mode):
            os.dup2(null, fd)
    os.close(null)
    gc.freeze()  # the front's objects: never collected here, their pages stay shared


class ForkServer:
    """The front's side of the fork server: boots it, asks it for executors (one at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._popen: subprocess.Popen | ForkedServerProcess | None = None
        self._sock: socket.socket | None = None
        self.forked_with_threads = False  # forked beside torch's OpenMP pool, maybe

    @property
    def pid(self) -> int | None:
        """The fork server's pid (None before the first executor)."""
        return None if self._popen is None else self._popen.pid

    def _boot(self) -> None:
        self._discard()
        self.forked_with_threads = False
        ours, theirs = socket.socketpair()
        with theirs:
            self._popen = subprocess.Popen(
                [sys.executable, "-c", _FORK_SERVER_BOOT, str(theirs.fileno()), *sys.path],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        self._sock = ours

    def boot_here(self, threaded: bool = False) -> None:
        """Start the fork server as a fork of this process (`start_fork_server_here`);
        `threaded`: torch's OpenMP pool may be among this process's threads."""
        with self._lock:
            if self._popen is not None and self._popen.poll() is None:
                return
            self._discard()
            ours, theirs = socket.socketpair()
            with theirs:
                self._popen = ForkedServerProcess(theirs, ours)
            self._sock = ours
            self.forked_with_threads = threaded

    def _discard(self) -> None:
        """Drop the fork server (dead, or out of step after a timeout): a new one boots."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._popen is not None:
            if self._popen.poll() is None:
                self._popen.kill()
            self._popen.wait()
            self._popen = None

    def forget_in_child(self) -> None:
        """After os.fork() of the front: the child must not share the parent's fork server
        (nor keep it alive after the parent is gone by holding its socket)."""
        self._lock = threading.Lock()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._popen = None

    def fork(self, conn_fd: int, main: str, kwargs: dict, *,
             timeout: float = FORK_TIMEOUT_S) -> ForkedProcess:
        try:
            cwd = os.getcwd()
        except OSError:  # removed since: the executor stays where the fork server is
            cwd = ""
        request = pickle.dumps(_Request(main, kwargs, list(sys.path), cwd, dict(os.environ)))
        with self._lock:
            for attempt in range(2):  # a second time with a new fork server if it died
                if self._popen is None or self._popen.poll() is not None:
                    self._boot()
                assert self._sock is not None and self._popen is not None
                try:
                    return self._ask(request, conn_fd, timeout)
                except (BrokenPipeError, ConnectionResetError, EOFError):
                    if attempt:
                        pid = self._popen.pid
                        try:
                            code: int | None = self._popen.wait(timeout=5)
                        except subprocess.TimeoutExpired:
                            code = None
                        self._discard()
                        raise RuntimeError(
                            f"the executor fork server (pid {pid}) exited with code {code} "
                            "before it forked an executor: its stderr says why") from None
                except TimeoutError:
                    pid = self._popen.pid
                    self._discard()
                    raise TimeoutError(
                        f"the executor fork server (pid {pid}) forked no executor within "
                        f"{timeout:.0f}s (it imports {', '.join(PRELOAD)} once, then forks)"
                    ) from None
                self._discard()
        raise AssertionError("unreachable")

    def _ask(self, request: bytes, conn_fd: int, timeout: float) -> ForkedProcess:
        assert self._sock is not None
        self._sock.settimeout(timeout)
        # The executor's connection and this moment's stdout/stderr (pytest may capture them;
        # a closed one is replaced by /dev/null).
        streams = [fd if _is_open(fd) else os.open(os.devnull, os.O_WRONLY) for fd in (1, 2)]
        try:
            socket.send_fds(self._sock, [_HEADER.pack(len(request))], [conn_fd, *streams])
        finally:
            for fd in streams:
                if fd > 2:
                    os.close(fd)
        self._sock.sendall(request)
        data, fds, _, _ = socket.recv_fds(self._sock, _REPLY.size, 1)
        if len(data) < _REPLY.size:
            for fd in fds:
                os.close(fd)
            raise EOFError("the executor fork server closed its socket")
        (pid,) = _REPLY.unpack(data)
        if pid <= 0 or not fds:
            for fd in fds:
                os.close(fd)
            raise OSError(f"the executor fork server could not fork (errno {-pid})")
        return ForkedProcess(pid, fds[0])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared_fork_server() -> ForkServer:
    """This process's fork server (one for all its workers: the imports are paid once)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ForkServer()
        return _shared


def _after_fork_in_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()
    if _shared is not None:
        _shared.forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------- inside the fork server
def serve(control_fd: int) -> None:
    """The fork server's loop: preload, then fork an executor per request until the front's
    socket closes; then give the executors `ORPHAN_GRACE_S` to exit and kill the rest."""
    # Ctrl-C reaches the whole process group: the front decides when the fork server ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in PRELOAD:
        try:
            __import__(module)
        except ImportError:
            if module == PRELOAD[-1]:
                raise
    control = socket.socket(fileno=control_fd)
    # poll, not select: the fd keeps the front's number, over 1023 in a process with many files
    readable = select.poll()
    readable.register(control, select.POLLIN)
    children: set[int] = set()
    while True:
        if not readable.poll(1000 if children else None):
            _reap(children)
            continue
        _reap(children)
        try:
            request, fds = _receive(control)
        except (OSError, EOFError):
            break
        if request is None:
            break
        conn_fd, stdout_fd, stderr_fd = fds
        try:
            pid = os.fork()
        except OSError as error:
            for fd in fds:
                os.close(fd)
            control.sendall(_REPLY.pack(-(error.errno or 1)))
            continue
        if pid == 0:
            _run_child(control, conn_fd, stdout_fd=stdout_fd, stderr_fd=stderr_fd,
                       request=request)
        for fd in fds:
            os.close(fd)
        children.add(pid)
        pidfd = os.pidfd_open(pid)  # not reaped yet: this loop reaps, and only after this
        try:
            socket.send_fds(control, [_REPLY.pack(pid)], [pidfd])
        except OSError:
            break
        finally:
            os.close(pidfd)
    control.close()
    _end(children)


def _receive(control: socket.socket) -> tuple[_Request | None, list[int]]:
    data, fds, _, _ = socket.recv_fds(control, _HEADER.size, 3)
    if not data:
        return None, fds
    while len(data) < _HEADER.size:
        more = control.recv(_HEADER.size - len(data))
        if not more:
            raise EOFError
        data += more
    (size,) = _HEADER.unpack(data)
    body = bytearray()
    while len(body) < size:
        more = control.recv(size - len(body))
        if not more:
            raise EOFError
        body += more
    if len(fds) != 3:
        raise OSError(f"a fork request came with {len(fds)} file descriptors, not 3")
    return pickle.loads(body), fds


def _reap(children: set[int]) -> None:
    while children:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)


def _end(children: set[int]) -> None:
    """The front is gone: its executors see their connections close and exit; kill any that
    have not after the grace period (a pipeline stuck in C code)."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(children)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)  # still our unreaped child: the pid is its own
        except ProcessLookupError:
            pass
    while children:
        time.sleep(0.01)
        _reap(children)


def _run_child(control: socket.socket, conn_fd: int, *, stdout_fd: int, stderr_fd: int,
               request: _Request) -> None:
    """In the forked child: become what a fresh interpreter would be, run the request's
    main, and exit without the interpreter's teardown (seconds with torch loaded)."""
    code = 1
    try:
        control.close()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        os.close(stdout_fd)
        os.close(stderr_fd)
        sys.path[:] = request.sys_path
        os.environ.clear()
        os.environ.update(request.environ)
        try:
            os.chdir(request.cwd)
        except OSError:
            pass
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()  # from the OS's entropy, as a fresh interpreter's would be
        run_main(Connection(conn_fd), request.main, request.kwargs)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
