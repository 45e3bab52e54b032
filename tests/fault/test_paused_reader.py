"""A reader paused for longer than job_gc_timeout_ms (a debugger, a long checkpoint save;
here SIGSTOP) (issue 12.5): under DYNAMIC it joins its job again when it resumes and the
epoch is still exactly once; otherwise it fails with an error naming job_gc_timeout_ms, never
with an internal "not known" error. CLI dispatcher and workers, a consumer subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, ProcessCluster, ServerProcess, wait_until
from tests.fault.helpers import Consumer, tally_all
from torch_dataservice.client.membership import HEARTBEAT_INTERVAL_S

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(240)]

N = 20_000
PAUSE_DEADLINE_S = 30.0  # a pause lasts until the dispatcher logged what it outlived
SILENT = "what it did not acknowledge"  # a client silent past worker_timeout_ms
RELEASED = ": released"  # a client silent past job_gc_timeout_ms


def pause_until_logged(proc: subprocess.Popen, dispatcher: ServerProcess, *lines: str,
                       meanwhile: Callable[[], object] = lambda: None) -> None:
    """SIGSTOP the reader (then run `meanwhile`) and SIGCONT it once the dispatcher logged
    each of `lines` more often than before: a pause as long as needed (job_gc_timeout_ms or
    worker_timeout_ms plus the dispatcher's check), however busy the host, and no longer."""
    before = {line: dispatcher.output.count(line) for line in lines}
    proc.send_signal(signal.SIGSTOP)
    meanwhile()
    wait_until(lambda: all(dispatcher.output.count(line) > before[line] for line in lines),
               PAUSE_DEADLINE_S, f"the dispatcher to log {lines} while the reader is paused")
    proc.send_signal(signal.SIGCONT)


def test_a_paused_dynamic_reader_goes_on_exactly_once(process_cluster: ProcessCluster,
                                                      tmp_path: Path) -> None:
    dispatcher = process_cluster.start_dispatcher("--job-gc-timeout-ms", "300")
    process_cluster.start_workers(2)
    consumer = Consumer(process_cluster, N, tmp_path / "out.txt", "paused", max_rate=4000)
    assert consumer.wait_received(N // 5, 60), consumer.output()
    pause_until_logged(consumer.proc, dispatcher, RELEASED)
    result = consumer.wait(90)
    assert result.done and result.missing == 0 and result.duplicated == 0, (
        f"{result}\n{consumer.output()}\n{dispatcher.output[-2000:]}")
    assert "joined iteration" in consumer.output()


def test_a_reader_paused_past_worker_timeout_says_it_was_taken_for_dead(
        process_cluster: ProcessCluster, tmp_path: Path) -> None:
    """Paused longer than worker_timeout_ms (not job_gc_timeout_ms): the dispatcher hands what
    the reader held unacknowledged to the job's other readers; the reader, alone here, goes on
    exactly once (it drops what comes again) and says in its log what happened, since with
    other readers an element may then be delivered twice."""
    dispatcher = process_cluster.start_dispatcher("--worker-timeout-ms", "1500")
    process_cluster.start_worker()
    consumer = Consumer(process_cluster, N, tmp_path / "out.txt", "silent", max_rate=4000)
    assert consumer.wait_received(N // 5, 60), consumer.output()
    pause_until_logged(consumer.proc, dispatcher, SILENT)
    result = consumer.wait(90)
    assert result.done and result.missing == 0 and result.duplicated == 0, (
        f"{result}\n{consumer.output()}\n{dispatcher.output[-2000:]}")
    assert "taken for dead" in consumer.output() and "delivered twice" in consumer.output()


OFF_READER = """
import sys, time
import torch_dataservice as tds
pipeline = tds.Pipeline.range(10**9).apply(tds.distribute("parallel_epochs", sys.argv[1]))
try:
    for i, _ in enumerate(pipeline):
        if i == 100:
            print("reading", flush=True)
        time.sleep(0.001)
except Exception as error:
    print(f"ERROR {type(error).__name__}: {error}", flush=True)
"""


def test_a_paused_off_reader_fails_naming_job_gc_timeout(process_cluster: ProcessCluster) -> None:
    dispatcher = process_cluster.start_dispatcher("--job-gc-timeout-ms", "300")
    process_cluster.start_worker()
    proc = subprocess.Popen([sys.executable, "-c", OFF_READER, process_cluster.target],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=process_cluster.env, cwd=REPO)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "reading"
        pause_until_logged(proc, dispatcher, RELEASED)
        output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert "ERROR" in output and "job_gc_timeout_ms" in output, output
    assert "not known" not in output, output


def test_a_paused_reader_sharing_a_job_drops_what_was_handed_again(
        process_cluster: ProcessCluster, tmp_path: Path) -> None:
    """Two readers share an exactly-once DYNAMIC epoch; one is paused (SIGSTOP) past
    worker_timeout_ms while a worker is killed, so the splits it held elements of are handed
    to the other reader. Told on its return that it was declared silent, it drops what it
    holds unacknowledged before yielding anything more: duplicates stay within what it
    yielded during its last heartbeat interval before the pause, and nothing is missing."""
    rate = 2000  # elements/s per reader, taken one at a time
    n = 40_000
    dispatcher = process_cluster.start_dispatcher("--worker-timeout-ms", "1500")
    workers = process_cluster.start_workers(2)
    go = tmp_path / "go"
    consumers = [Consumer(process_cluster, n, tmp_path / f"out{i}.txt", "shared", max_rate=rate,
                          flush_every=1, go=go) for i in range(2)]
    Consumer.start_together(consumers, go, 60)
    paused = consumers[0]
    assert paused.wait_received(n // 10, 60), paused.output()
    # Resumed once it was declared silent and the killed worker's splits were handed again.
    pause_until_logged(paused.proc, dispatcher, SILENT, "missed heartbeats",
                       meanwhile=workers[0].kill)
    for consumer in consumers:
        consumer.wait(120)
    result = tally_all([c.out for c in consumers], n)
    window = rate * HEARTBEAT_INTERVAL_S  # what it yields in one heartbeat interval
    logs = "\n".join(c.output() for c in consumers)
    assert result.done and result.missing == 0 and result.duplicated <= window, (
        f"{result} (at most {window:.0f} duplicates)\n{logs}\n{dispatcher.output[-2000:]}")
    assert "silent for" in dispatcher.output  # it really was declared silent
    assert "dropped" in paused.output(), paused.output()
