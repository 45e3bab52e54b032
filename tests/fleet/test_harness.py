"""The harness itself: hosts share the network and nothing else, a blocked port really drops,
and nothing is left behind."""

from __future__ import annotations

import subprocess

import pytest

from tests.fleet.hosts import Fleet, _kept_under_tmp, can_connect

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # servers as subprocesses, in namespaces

LISTEN = ("import socket,sys,time\n"
          "s=[socket.create_server(('0.0.0.0',p)) for p in (7001,7002)]\n"
          "print('listening',flush=True)\n"
          "time.sleep(60)\n")


@pytest.mark.timeout(60)
def test_hosts_share_only_the_network_and_a_block_drops(fleet: Fleet) -> None:
    a, b = fleet["a"], fleet["b"]
    probe = ("import socket,os,pathlib\n"
             "pathlib.Path('/tmp/mine').write_text(socket.gethostname())\n"
             "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()),"
             " sorted(os.listdir('/tmp')), sorted(os.listdir('/dev/shm')))\n")
    seen = {h.name: h.python(probe).stdout.strip().split(maxsplit=2) for h in (a, b)}
    assert seen["a"][:2] == ["host-a", a.address] and seen["b"][:2] == ["host-b", b.address]
    # Each /tmp holds only its own file (and a checkout or virtualenv kept from the machine's).
    kept = sorted({"mine", *(path.split("/")[0] for path in _kept_under_tmp())})
    assert seen["a"][2] == seen["b"][2] == f"{kept} []"
    server = b.spawn(argv=["python3", "-c", LISTEN])
    server.wait_line("listening", 30)
    assert can_connect(a, b.address, 7001) and can_connect(a, b.address, 7002)
    with fleet.block_tcp_port(b, 7002):
        assert not can_connect(a, b.address, 7002)
        assert can_connect(a, b.address, 7001)
        assert fleet.dropped_packets(b) > 0
    assert can_connect(a, b.address, 7002)


@pytest.mark.timeout(60)
def test_close_removes_namespaces_and_processes() -> None:
    hosts = Fleet(["x", "y"]).start()
    sleeper = hosts["x"].spawn(argv=["sleep", "300"])
    names = [h.netns for h in hosts.hosts.values()] + [hosts.switch]
    hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed
    assert sleeper.proc.poll() is not None
    assert not hosts.shared.exists()
