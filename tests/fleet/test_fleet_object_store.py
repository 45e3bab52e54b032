"""Tar shards in an object store on a host of its own: moto's S3 server on host E, the
dispatcher on A, workers on B and C, the trainer on D, all across the fleet's network. An epoch
is read exactly once though worker B is SIGKILLed mid-shard, and the store sees one listing
(the trainer's registration), counted by the store itself."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import wait_until
from tests.fleet.hosts import Fleet
from tests.integration.object_store import (
    BUCKET,
    SHARDS,
    Recording,
    assert_one_epoch,
    client_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # servers in namespaces

STORE_PORT, DISPATCHER_PORT, WORKER_PORT = 5300, 5000, 5001


@pytest.mark.timeout(240)
def test_shards_from_a_store_host_read_once_through_a_worker_kill(fleet: Fleet) -> None:
    a, b, c, d, e = (fleet[name] for name in "abcde")
    recording = Recording(fleet.shared / "s3-requests.jsonl")
    store = e.spawn(argv=[sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p",
                          str(STORE_PORT)],
                    env=fleet.env(MOTO_ENABLE_RECORDING="1",
                                  MOTO_RECORDER_FILEPATH=str(recording.path)))
    store.wait_line("Running on", 60)
    endpoint = f"http://{e.address}:{STORE_PORT}"
    filled = d.run([sys.executable, "-m", "tests.integration.object_store", endpoint],
                   timeout_s=120)
    assert filled.returncode == 0, filled.stderr
    env = client_env(fleet.env(TORCH_DATASERVICE_TOKEN="fleet-store-token"), endpoint,
                     *json.loads(filled.stdout))
    dispatcher = a.spawn("dispatcher", "--host", "0.0.0.0", "--port", str(DISPATCHER_PORT),
                         "--worker-timeout-ms", "1000", env=env)
    dispatcher.wait_serving()
    workers = [host.spawn("worker", "--dispatcher", f"{a.address}:{DISPATCHER_PORT}",
                          "--host", "0.0.0.0", "--port", str(WORKER_PORT), "--processes", "1",
                          "--heartbeat-interval-ms", "100", env=env) for host in (b, c)]
    for worker in workers:
        worker.wait_serving()
    mark = len(recording.requests())
    out = fleet.shared / "samples.txt"
    reader = d.spawn(argv=[sys.executable, "-m", "tests.integration.s3_reader",
                           f"{a.address}:{DISPATCHER_PORT}", "tar",
                           f"s3://{BUCKET}/shards/*.tar", str(out), "60"], env=env)

    def received() -> int:
        return out.read_text().count("\n") if out.exists() else 0

    wait_until(lambda: received() >= 60 or reader.proc.poll() is not None, 120,
               "the trainer's first 60 samples")
    workers[0].kill()  # not restarted: declared dead after 1 s, its shards handed again
    assert reader.wait_exit(150) == 0, reader.output[-4000:]
    lines = out.read_text().splitlines()
    assert lines[-1:] == ["done"], reader.output[-4000:]
    assert_one_epoch(lines[:-1])
    assert "requeued" in dispatcher.output, dispatcher.output[-3000:]
    listings = recording.listings(mark)
    assert len(listings) == 1 and "list-type=2" in listings[0], listings
    shards_read = {key for key, _ in recording.object_reads(mark)}
    assert shards_read == {f"shards/{i:03d}.tar" for i in range(SHARDS)}
