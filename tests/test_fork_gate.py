"""A fork waits for our gRPC calls in flight (fork_gate.py), so gRPC's fork handlers run: a
reader's heartbeat under way at the moment a training script forks made gRPC print "skipping
fork() handlers" and left the child gRPC's state mid-call (issue 24.1). Real processes: the
server runs in a process of its own (a server in the forking process is always in gRPC)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import subprocess_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SCRIPT = """
    import os, subprocess, sys, threading, time

    SERVER = '''
    import sys, time, grpc
    from concurrent.futures import ThreadPoolExecutor

    def slow(request, context):
        time.sleep(1.0)
        return request

    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(slow)})])
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    sys.stdin.read()
    '''

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    from torch_dataservice import rpc

    call = rpc.channel_to(f"127.0.0.1:{port}").unary_unary("/test.Slow/Call")
    assert call(b"warm", timeout=30) == b"warm"
    started = []

    def slow_call():
        started.append(time.monotonic())
        assert call(b"x", timeout=30) == b"x"

    caller = threading.Thread(target=slow_call)
    caller.start()
    time.sleep(0.3)  # the call is in flight (the server holds it 1 s)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked = time.monotonic()
    os.waitpid(pid, 0)
    caller.join()
    assert call(b"after", timeout=30) == b"after"  # this process's gRPC still works
    print(f"waited {forked - started[0]:.2f}")
    server.stdin.close()
    server.wait(30)
"""


def test_a_fork_waits_for_a_call_in_flight_and_grpc_runs_its_fork_handlers(tmp_path) -> None:
    script = tmp_path / "fork_during_call.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=subprocess_env(), timeout=80)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping fork() handlers" not in result.stderr
    assert result.stderr == ""
    waited = float(result.stdout.split()[-1])
    assert waited >= 0.9  # the fork came after the call's end
