"""Several "hosts" on this machine, so that the service is tested across a network.

Each host is a Linux network namespace with its own address in 198.51.100.0/24 (TEST-NET-2,
RFC 5737: documentation only, never routed), a UTS namespace (its own host name) and a mount
namespace (its own /tmp and /dev/shm, and an /etc/hosts that names every host, as DNS would on
a cluster). Nothing but the network is shared, plus one directory (`Fleet.shared`, outside
/tmp) that stands for the shared filesystem of a cluster (certificates, port files, results).

Topology: a "switch" namespace holds a bridge; each host's `eth0` is a veth whose peer is a
port of that bridge. Nothing touches the root namespace, so deleting the namespaces removes
every link, and no packet can leave the machine (the switch has no uplink).

Each host has an anchor process (`sleep infinity`) that owns its UTS and mount namespaces;
every process of the host enters the anchor's namespaces with `nsenter`, so the host's
processes share its /tmp as they would on one machine.

Blocking a port: there is no iptables/nft on the CI machines and the kernel has no tc drop
action, so `Fleet.block_tcp_port` puts an HTB qdisc on the switch port toward the host and
classifies TCP packets to that port into a class whose `pfifo limit 0` drops them all: a
firewall in the network that silently drops SYNs, the worst case for a client.

Names carry this process's pid (`tdsf<pid>n<k>-<host>`), so a leftover from a crashed run
never collides with a new one; `clean_stale()` removes those whose pid is gone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import count
from pathlib import Path

from tests.conftest import REPO, ServerProcess, subprocess_env

PREFIX = "tdsf"
SUBNET = "198.51.100"
SHARED_ROOT = Path("/var/tmp")  # not /tmp: each host mounts its own there


def _kept_under_tmp() -> list[str]:
    """The directories under /tmp that the hosts' processes need (this checkout, the
    virtualenv, PYTHONPATH entries), relative to /tmp, outermost only."""
    tmp = Path("/tmp").resolve()
    wanted = [REPO, Path(sys.prefix), Path(os.path.realpath(sys.executable)).parent,
              *(Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    kept: list[Path] = []
    for path in sorted({p.resolve() for p in wanted}, key=lambda p: len(p.parts)):
        if path.is_relative_to(tmp) and path != tmp and path.exists() and not any(
                path.is_relative_to(k) for k in kept):
            kept.append(path)
    return [str(p.relative_to(tmp)) for p in kept]
NAME_RE = re.compile(rf"^{PREFIX}(\d+)n(\d+)-")
COMMAND_TIMEOUT_S = 15.0
_runs = count()
_live: set[str] = set()  # tags of fleets of this process that are up


class FleetError(RuntimeError):
    """The harness could not build or use the fleet (namespaces need root and iproute2)."""


def _run(*argv: str, timeout_s: float = COMMAND_TIMEOUT_S, check: bool = True
         ) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise FleetError(f"{' '.join(argv)}: {error}") from error
    if check and result.returncode != 0:
        raise FleetError(f"{' '.join(argv)} failed ({result.returncode}): "
                         f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(netns: str) -> None:
    """SIGKILL every process in `netns` (whatever process group it is in), then delete it."""
    for _ in range(50):
        pids = [int(p) for p in _run("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    _run("ip", "netns", "del", netns, check=False)


def clean_stale() -> None:
    """Remove namespaces and shared directories of fleets whose process is gone (a crashed
    or SIGKILLed run), or of this process but not up (its pid was reused)."""
    listing = _run("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ", 1)[0]
        match = NAME_RE.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        tag = name.split("-", 1)[0]
        if not _alive(pid) or (pid == os.getpid() and tag not in _live):
            _kill_namespace(name)
    for path in SHARED_ROOT.glob(f"{PREFIX}*"):
        match = re.match(rf"^{PREFIX}(\d+)n\d+$", path.name)
        if match and (not _alive(int(match.group(1))) or (
                int(match.group(1)) == os.getpid() and path.name not in _live)):
            shutil.rmtree(path, ignore_errors=True)


class HostProcess(ServerProcess):
    """A process on a host (by default `python -m torch_dataservice ARGS`), output collected
    line by line; `kill()` kills its process group."""

    def __init__(self, host: Host, args: list[str], env: dict[str, str],
                 argv: Sequence[str] | None = None) -> None:
        self.host = host
        self._argv = list(argv) if argv is not None else None
        super().__init__(args, env)

    def _start(self) -> None:
        self.lines = []
        self.address = ""
        argv = self._argv or [sys.executable, "-m", "torch_dataservice", *self.args]
        self.proc = subprocess.Popen(
            self.host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, env=self._env, start_new_session=True)
        self._follow()

    def wait_line(self, needle: str, timeout_s: float) -> str:
        """The first output line containing `needle`; FleetError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._line_came.clear()  # a line collected from now on ends the wait below
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                break
            self._line_came.wait(0.05)
        for line in list(self.lines):
            if needle in line:
                return line
        raise FleetError(f"no line with {needle!r} from {self.host.hostname} "
                         f"{self.args[:1]} within {timeout_s}s:\n{self.output[-4000:]}")


class Host:
    """One host of the fleet: `address` is its only routable address (on `eth0`)."""

    def __init__(self, fleet: Fleet, name: str, index: int) -> None:
        self.fleet = fleet
        self.name = name
        self.hostname = f"host-{name}"
        self.address = f"{SUBNET}.{index}"
        self.netns = f"{fleet.tag}-{name}"
        self.port = f"p-{name}"  # its port on the switch's bridge
        self._anchor: subprocess.Popen[str] | None = None

    def start(self) -> None:
        sw = self.fleet.switch
        _run("ip", "netns", "add", self.netns)
        _run("ip", "-n", sw, "link", "add", self.port, "type", "veth", "peer", "name", "eth0",
             "netns", self.netns)
        _run("ip", "-n", sw, "link", "set", self.port, "master", "br0", "up")
        for args in (["addr", "add", f"{self.address}/24", "dev", "eth0"],
                     ["link", "set", "eth0", "up"], ["link", "set", "lo", "up"],
                     # A default route as real hosts have (what servers bound to 0.0.0.0
                     # advertise is the address of the route's interface); it leads nowhere.
                     ["route", "add", "default", "dev", "eth0"]):
            _run("ip", "-n", self.netns, *args)
        # The host's own /tmp hides the machine's, but a checkout or virtualenv that lives
        # under /tmp (a CI clone) must stay visible: the machine's /tmp is held at $3 and
        # those directories are bound back into the new /tmp.
        hold = self.fleet.shared / f".tmp-{self.name}"
        hold.mkdir()
        script = ('hostname "$1" && mount --bind /tmp "$3" && '
                  'mount -t tmpfs -o mode=1777,size=2g tdsfleet /tmp && '
                  'shift 3 && for p in "$@"; do mkdir -p "/tmp/$p" && '
                  'mount --bind "$hold/$p" "/tmp/$p" || exit 1; done && umount -l "$hold" && '
                  'mount -t tmpfs -o mode=1777,size=2g tdsfleet /dev/shm && '
                  'mount --bind "$hosts" /etc/hosts && echo ready && exec sleep infinity')
        script = f'hosts="$2"; hold="$3"; {script}'
        self._anchor = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "sh", "-c",
             script, "anchor", self.hostname, str(self.fleet.shared / "hosts"), str(hold),
             *_kept_under_tmp()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True)
        assert self._anchor.stdout is not None
        line = self._anchor.stdout.readline()  # the anchor exits (EOF) if a step fails
        if line.strip() != "ready":
            self._anchor.wait(5)
            raise FleetError(f"host {self.hostname}: could not set up its namespaces: "
                             f"{self._anchor.stderr.read() if self._anchor.stderr else ''}")

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run on this host (its network, host name and mounts; cwd: the repo)."""
        assert self._anchor is not None, "host not started"
        return ["nsenter", f"--target={self._anchor.pid}", "--net", "--uts", "--mount",
                f"--wd={REPO}", "--", *argv]

    def spawn(self, *args: str, env: dict[str, str] | None = None,
              argv: Sequence[str] | None = None) -> HostProcess:
        """Start `python -m torch_dataservice ARGS` (or `argv`) on this host."""
        process = HostProcess(self, list(args) or list(argv or ["?"]),
                              env if env is not None else self.fleet.env(), argv)
        self.fleet.processes.append(process)
        return process

    def run(self, argv: Sequence[str], timeout_s: float = 60.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to completion (FleetError if it outlives `timeout_s`)."""
        try:
            return subprocess.run(self.command(argv), capture_output=True, text=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL,
                                  env=env if env is not None else self.fleet.env())
        except subprocess.TimeoutExpired as error:
            raise FleetError(f"{argv} on {self.hostname} outlived {timeout_s}s:\n"
                             f"{error.stdout}\n{error.stderr}") from error

    def python(self, code: str, *args: str, timeout_s: float = 60.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.run([sys.executable, "-c", code, *args], timeout_s, env)

    def stop(self) -> None:
        if self._anchor is not None:
            for stream in (self._anchor.stdout, self._anchor.stderr):
                if stream is not None:
                    stream.close()
        _kill_namespace(self.netns)
        if self._anchor is not None:
            try:
                self._anchor.wait(5)
            except subprocess.TimeoutExpired:
                pass


class Fleet:
    """Hosts named `names` (addresses .1, .2, ... in order) on one switch."""

    def __init__(self, names: Sequence[str]) -> None:
        self.tag = f"{PREFIX}{os.getpid()}n{next(_runs)}"
        self.switch = f"{self.tag}-switch"
        self.shared = SHARED_ROOT / self.tag
        self.hosts = {name: Host(self, name, i) for i, name in enumerate(names, start=1)}
        self.processes: list[HostProcess] = []

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def start(self) -> Fleet:
        if os.geteuid() != 0:
            raise FleetError("the fleet tests need root (network, UTS and mount namespaces); "
                             f"running as uid {os.geteuid()}")
        for tool in ("ip", "tc", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise FleetError(f"the fleet tests need `{tool}` (iproute2 / util-linux)")
        clean_stale()
        _live.add(self.tag)
        try:
            self.shared.mkdir(mode=0o755)
            (self.shared / "hosts").write_text(
                "127.0.0.1 localhost\n::1 localhost\n" + "".join(
                    f"{h.address} {h.hostname}\n" for h in self.hosts.values()))
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts.values():
                host.start()
        except BaseException:
            self.close()
            raise
        return self

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a fleet process: this checkout importable, no address of the
        test process's own service, and `extra`."""
        env = subprocess_env(OMP_NUM_THREADS="1", **extra)
        for name in ("TORCH_DATASERVICE_ADDRESS", "TORCH_DATASERVICE_TOKEN",
                     "TORCH_DATASERVICE_TLS_CA", "TORCH_DATASERVICE_TLS_CERT",
                     "TORCH_DATASERVICE_TLS_KEY"):
            if name not in extra:
                env.pop(name, None)
        return env

    def kill_processes(self) -> None:
        """SIGKILL every process started through `spawn` (and its process group)."""
        for process in self.processes:
            process.kill()
            if process.proc.stdout is not None:
                process.proc.stdout.close()
        self.processes.clear()

    @contextmanager
    def block_tcp_port(self, host: Host, port: int) -> Iterator[None]:
        """Drop every TCP packet toward `host`:`port` at the switch (see the module
        docstring); the rule is removed on exit."""
        dev = host.port
        tc = ["ip", "netns", "exec", self.switch, "tc"]
        _run(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "0")
        try:
            _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb",
                 "rate", "10gbit")
            _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "2:", "pfifo",
                 "limit", "0")
            _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                 "1", "u32", "match", "ip", "protocol", "6", "0xff", "match", "ip", "dport",
                 str(port), "0xffff", "flowid", "1:2")
            yield
        finally:
            _run(*tc, "qdisc", "del", "dev", dev, "root", check=False)

    def dropped_packets(self, host: Host) -> int:
        """Packets the block toward `host` dropped so far (0 when there is no block)."""
        out = _run("ip", "netns", "exec", self.switch, "tc", "-s", "qdisc", "show", "dev",
                   host.port).stdout
        match = re.search(r"qdisc pfifo 2:.*?dropped (\d+)", out, re.DOTALL)
        return int(match.group(1)) if match else 0

    def close(self) -> None:
        """Kill every process, delete every namespace (links and bridge go with them) and the
        shared directory; safe to call twice and after a partial start."""
        try:
            self.kill_processes()
        finally:
            for host in self.hosts.values():
                host.stop()
            _kill_namespace(self.switch)
            shutil.rmtree(self.shared, ignore_errors=True)
            _live.discard(self.tag)


def can_connect(host: Host, address: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection from `host` to `address`:`port` is accepted in time."""
    code = ("import socket,sys\n"
            "try:\n"
            f"    socket.create_connection(({address!r}, {port}), timeout={timeout_s}).close()\n"
            "except OSError:\n"
            "    sys.exit(1)\n")
    return host.python(code, timeout_s=timeout_s + 30).returncode == 0
