"""The worker's gRPC handlers. GetElements replies with a raw frame, StreamElements streams the
same frame in chunks (see wire/frame.py); readers use StreamElements."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import grpc

from torch_dataservice.proto import worker_pb2
from torch_dataservice.rpc import WORKER_SERVICE_NAME, check_request
from torch_dataservice.wire import frame
from torch_dataservice.wire.inprocess import payload_nbytes
from torch_dataservice.worker.local import encode_elements
from torch_dataservice.worker.metrics import WorkerCounters
from torch_dataservice.worker.shm import PiecedPayload
from torch_dataservice.worker.tasks import TaskManager

logger = logging.getLogger(__name__)

FETCH_WAIT_S = 0.5  # long-poll: an empty reply after this, so no request holds a thread long


class WorkerService:
    def __init__(self, tasks: TaskManager, is_registered: Callable[[], bool]) -> None:
        self._tasks = tasks
        self._is_registered = is_registered
        self.counters = WorkerCounters()  # what was sent, by transport (worker/metrics.py)

    def fetch(self, request: worker_pb2.GetElementsRequest, local: bool = False,
              transport: str | None = None) -> tuple[worker_pb2.ElementBatchHeader, list]:
        """The elements for one GetElements request, as payloads for the wire (gRPC, the data
        port) or, with `local` (an in-process reader), as they are buffered: elements of an
        executor thread then stay the objects themselves (`LocalElement`, wire/inprocess.py)."""
        elements, end, error = self._tasks.fetch(request, FETCH_WAIT_S)
        if not local:
            failed = encode_elements(elements)  # encoded here, by this reader's thread
            if failed is not None:  # the pipeline made an element that cannot be sent
                self._tasks.fail(request.task_id, failed)
                end, error = False, failed
        header = worker_pb2.ElementBatchHeader(end_of_sequence=end)
        if end:
            header.dropped_at_end = self._tasks.dropped_at_end(request.task_id)
        for element in elements:
            info = header.elements.add(offset=element.offset)
            if element.split is not None:
                info.has_split = True
                info.split.repetition, info.split.index = element.split
        if error is not None:
            header.has_error = True
            header.error.type, header.error.message, header.error.traceback = error
        payloads = [element.payload for element in elements]
        if local or transport:  # not the data port, which sends pieced payloads as they are
            payloads = [payload.joined() if type(payload) is PiecedPayload else payload
                        for payload in payloads]
        if payloads and (local or transport):  # once per reply (the data port counts its own)
            self.counters.sent(transport or "local", len(payloads),
                               sum(payload_nbytes(p) for p in payloads))
        return header, payloads

    def GetElements(self, request: worker_pb2.GetElementsRequest,
                    context: grpc.ServicerContext) -> bytes:
        header, payloads = self._fetch_or_abort(request, context)
        return frame.build_frame(header, [[payload] for payload in payloads])

    def StreamElements(self, request: worker_pb2.GetElementsRequest,
                       context: grpc.ServicerContext) -> Iterator[bytes]:
        header, payloads = self._fetch_or_abort(request, context)
        return frame.stream_frame(header, payloads)

    def _fetch_or_abort(self, request: worker_pb2.GetElementsRequest,
                        context: grpc.ServicerContext) -> tuple[
                            worker_pb2.ElementBatchHeader, list]:
        if not self._is_registered():
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "worker has not registered with the dispatcher yet")
        try:
            check_request(request)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            header, payloads = self.fetch(request, transport="grpc")
        except LookupError:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"task {request.task_id} is not known here yet")
        except ValueError as error:  # a request that does not fit its task
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except grpc.RpcError as error:  # the task's dataset could not be fetched
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"task {request.task_id} cannot run here: {error.details()}")
        except Exception as error:
            logger.exception("GetElements failed")
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
        return header, payloads

    def ProcessTask(self, request: worker_pb2.ProcessTaskRequest,
                    context: grpc.ServicerContext) -> worker_pb2.ProcessTaskResponse:
        try:
            check_request(request)
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self._tasks.add(request.task)
        return worker_pb2.ProcessTaskResponse()

    def register(self, server: grpc.Server) -> None:
        handlers: dict[str, grpc.RpcMethodHandler] = {
            "GetElements": grpc.unary_unary_rpc_method_handler(
                self.GetElements,
                request_deserializer=worker_pb2.GetElementsRequest.FromString,
                response_serializer=None,  # already bytes
            ),
            "StreamElements": grpc.unary_stream_rpc_method_handler(
                self.StreamElements,
                request_deserializer=worker_pb2.GetElementsRequest.FromString,
                response_serializer=None,  # already bytes
            ),
            "ProcessTask": grpc.unary_unary_rpc_method_handler(
                self.ProcessTask,
                request_deserializer=worker_pb2.ProcessTaskRequest.FromString,
                response_serializer=worker_pb2.ProcessTaskResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(WORKER_SERVICE_NAME, handlers),))
