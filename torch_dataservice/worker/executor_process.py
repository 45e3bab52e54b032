"""The loop inside one executor process: run pipeline replicas, encode, send element bytes.

The worker front talks to it over one duplex `multiprocessing` connection. Each replica is a
thread here that iterates its pipeline, encodes every element (encoding and compression are
CPU work that must not run in the front) and sends it, but only while it holds credits: the
front grants a credit for every element it hands to a client, so a slow consumer stops the
pipeline instead of filling memory.

Messages, front -> here:   ("dataset", dataset_id, pipeline_bytes)
                           ("start", key, dataset_id, rewrites, compression, use_splits, credits)
                           ("credit", key, n)   ("split", key, request_id, index|None, skip)
                           ("stop", key)        ("shutdown",)
here -> front:             ("element", key, split|None, offset) then send_bytes(payload)
                           ("end", key)  ("error", key, type, message, traceback)
                           ("get_split", key, request_id, repetition)
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from torch_dataservice.errors import describe_exception
from torch_dataservice.pipeline import ExecutionContext, Pipeline, sharding
from torch_dataservice.wire import codec

logger = logging.getLogger(__name__)

ReplicaKey = tuple[int, int]  # (task id, replica index)


class _Stopped(Exception):
    """The front stopped this replica (task deleted or the worker shuts down)."""


class _Replica:
    """One copy of a task's pipeline, running on its own thread."""

    def __init__(self, executor: ExecutorLoop, key: ReplicaKey, pipeline: Pipeline,
                 compression: str | None, use_splits: bool, credits: int) -> None:
        self.key = key
        self._executor = executor
        self._pipeline = pipeline
        self._compression = compression
        self._use_splits = use_splits
        self._credits = credits
        self._cond = threading.Condition()
        self._stopped = False
        self._split_replies: dict[int, tuple[int | None, int]] = {}
        self._request_ids = itertools.count()
        self.thread = threading.Thread(target=self._run, name=f"replica-{key}", daemon=True)

    # --- called by the executor's receive loop
    def add_credits(self, n: int) -> None:
        with self._cond:
            self._credits += n
            self._cond.notify_all()

    def deliver_split(self, request_id: int, index: int | None, skip: int) -> None:
        with self._cond:
            self._split_replies[request_id] = (index, skip)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    # --- the replica thread
    def get_split(self, source_index: int, repetition: int) -> int | None:
        request_id = next(self._request_ids)
        self._executor.send(("get_split", self.key, request_id, repetition))
        with self._cond:
            while request_id not in self._split_replies:
                if self._stopped:
                    raise _Stopped
                self._cond.wait(1.0)
            index, _skip = self._split_replies.pop(request_id)
        return index

    def _take_credit(self) -> None:
        with self._cond:
            while self._credits <= 0 and not self._stopped:
                self._cond.wait(1.0)
            if self._stopped:
                raise _Stopped
            self._credits -= 1

    def _run(self) -> None:
        ctx = ExecutionContext(split_provider=self if self._use_splits else None)
        try:
            last_split = None
            offset = 0
            elements: Iterator[Any] = self._pipeline.iterate(ctx)
            for element in elements:
                split = ctx.current_split
                if split != last_split:
                    last_split, offset = split, 0
                else:
                    offset += 1
                payload = b"".join(codec.encode(element, self._compression))
                self._take_credit()
                wire_split = None if split is None else (split[1], split[2])
                self._executor.send_element(self.key, wire_split, offset, payload)
            self._executor.send(("end", self.key))
        except _Stopped:
            pass
        except BaseException as error:  # user code failed: the consumer must see it
            self._executor.send(("error", self.key, *describe_exception(error)))
        finally:
            self._executor.forget(self.key)


class ExecutorLoop:
    """Receives commands from the front and runs replicas until told to shut down."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()
        self._datasets: dict[str, bytes] = {}
        self._replicas: dict[ReplicaKey, _Replica] = {}
        self._lock = threading.Lock()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def send_element(self, key: ReplicaKey, split: tuple[int, int] | None, offset: int,
                     payload: bytes) -> None:
        with self._send_lock:  # header and payload must arrive back to back
            self._conn.send(("element", key, split, offset))
            self._conn.send_bytes(payload)

    def forget(self, key: ReplicaKey) -> None:
        with self._lock:
            self._replicas.pop(key, None)

    def _start(self, key: ReplicaKey, dataset_id: str, rewrites: list[tuple[str, int, int]],
               compression: str | None, use_splits: bool, credits: int) -> None:
        try:
            pipeline = cloudpickle.loads(self._datasets[dataset_id])
            pipeline = apply_rewrites(pipeline, rewrites)
        except BaseException as error:
            self.send(("error", key, *describe_exception(error)))
            return
        replica = _Replica(self, key, pipeline, compression, use_splits, credits)
        with self._lock:
            self._replicas[key] = replica
        replica.thread.start()

    def run(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "shutdown":
                break
            if kind == "dataset":
                self._datasets[message[1]] = message[2]
            elif kind == "start":
                self._start(*message[1:])
            else:
                with self._lock:
                    replica = self._replicas.get(message[1])
                if replica is None:
                    continue
                if kind == "credit":
                    replica.add_credits(message[2])
                elif kind == "split":
                    replica.deliver_split(message[2], message[3], message[4])
                elif kind == "stop":
                    replica.stop()
        with self._lock:
            replicas = list(self._replicas.values())
        for replica in replicas:
            replica.stop()


def apply_rewrites(pipeline: Pipeline, rewrites: list[tuple[str, int, int]]) -> Pipeline:
    """Static sharding rewrites, applied where the pipeline runs (never in the front)."""
    for kind, num_shards, index in rewrites:
        if kind == "files":
            pipeline = sharding.shard_files(pipeline, num_shards, index)
        elif kind == "data":
            pipeline = sharding.shard_data(pipeline, num_shards, index)
        elif kind == "hints":
            pipeline, found = sharding.resolve_shard_hints(pipeline, num_shards, index)
            if not found:
                logger.warning(
                    "sharding policy HINT: the pipeline has no shard(SHARD_HINT, SHARD_HINT); "
                    "every worker produces all of it"
                )
        else:
            raise ValueError(f"unknown rewrite {kind!r}")
    return pipeline


def executor_main(conn: Connection) -> None:
    """Entry point of an executor process (or thread, with num_processes=0)."""
    logging.basicConfig(level=logging.WARNING)
    try:
        ExecutorLoop(conn).run()
    finally:
        conn.close()

