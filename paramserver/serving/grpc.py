"""Serving over gRPC: the Open Inference Protocol's ``inference.GRPCInferenceService``.

The service's messages are the protocol's generated ones as ``tritonclient[grpc]`` ships them
(Triton's service is the protocol's with extensions), so this server and that client agree
on every field by construction. Inputs come as raw bytes (``raw_input_contents``, what
tritonclient sends) or typed contents; outputs go as raw bytes (BF16 too). A refused request
ends with INVALID_ARGUMENT (NOT_FOUND for an unknown model, RESOURCE_EXHAUSTED for an answer
over :data:`~paramserver.serving.protocol.MAX_RESPONSE_BYTES`, as gRPC's own limit on a
message ends) and its message; methods of Triton's extensions that serving has no use for
answer UNIMPLEMENTED. A request is at most :data:`~paramserver.serving.http.MAX_BODY_BYTES`.
A port that cannot be bound is a ConfigError naming ``--grpc-port``.
"""

from __future__ import annotations

import logging
import socket
from concurrent import futures
from typing import Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from paramserver.errors import ConfigError
from paramserver.serving.frontend import Frontend, cannot_listen
from paramserver.serving.http import MAX_BODY_BYTES
from paramserver.serving.protocol import (
    MAX_RESPONSE_BYTES,
    ProtocolError,
    Requested,
    brief,
    datatype_of,
    raw_bytes,
    version_parameters,
)

log = logging.getLogger(__name__)

# Where a typed input's values are, by datatype (FP16 and BF16 only travel raw).
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents",
}  # fmt: skip


class _Service(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.frontend.ready)

    def ModelReady(self, request: Any, context: Any) -> Any:
        known = request.name in self.frontend.endpoints
        return service_pb2.ModelReadyResponse(ready=known and self.frontend.ready)

    def ServerMetadata(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerMetadataResponse(**self.frontend.server_metadata())

    def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            metadata = self.frontend.endpoint(request.name).metadata()
        except ProtocolError as error:
            context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        tensors = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=metadata["name"],
            versions=metadata["versions"],
            platform=metadata["platform"],
            inputs=[tensors(**spec) for spec in metadata["inputs"]],
            outputs=[tensors(**spec) for spec in metadata["outputs"]],
        )

    def ModelInfer(self, request: Any, context: Any) -> Any:
        try:
            return self._infer(request)
        except ProtocolError as error:
            code = (
                grpc.StatusCode.NOT_FOUND if error.not_found
                else grpc.StatusCode.RESOURCE_EXHAUSTED if error.too_large
                else grpc.StatusCode.INVALID_ARGUMENT
            )  # fmt: skip
            context.abort(code, str(error))
        except Exception as error:  # a bug, not the client's: say so, keep serving
            log.exception("grpc infer on %s failed", request.model_name)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")

    def _infer(self, request: Any) -> Any:
        given = _inputs(request)
        requested = [Requested(output.name) for output in request.outputs]
        endpoint, outputs, version = self.frontend.infer(
            "grpc", request.model_name, given, requested
        )
        response = service_pb2.ModelInferResponse(
            model_name=endpoint.name, model_version="1", id=request.id
        )
        for key, value in version_parameters(version).items():
            parameter = response.parameters[key]
            if isinstance(value, int):
                parameter.int64_param = value
            else:
                parameter.string_param = value
        for output, tensor in outputs:
            response.outputs.add(
                name=output.name, datatype=datatype_of(tensor.dtype), shape=list(tensor.shape)
            )
            response.raw_output_contents.append(raw_bytes(tensor))
        return response


def _inputs(request: Any) -> list[tuple[str, str, Any, Any]]:
    """Each input's (name, datatype, shape, values): raw bytes in order, else its contents."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(f"{len(raw)} raw contents for {len(request.inputs)} inputs")
    given = []
    for i, entry in enumerate(request.inputs):
        if raw:
            values: Any = raw[i]
        else:
            field = _CONTENTS.get(entry.datatype)
            if field is None:
                raise ProtocolError(
                    f"input {brief(entry.name)}: {brief(entry.datatype)} travels raw only"
                )
            values = list(getattr(entry.contents, field))
        given.append((entry.name, entry.datatype, list(entry.shape), values))
    return given


class GrpcServing:
    """``frontend`` served over gRPC on ``host``:``port`` (0: a free port)."""

    def __init__(
        self, frontend: Frontend, host: str = "127.0.0.1", port: int = 0, threads: int = 4
    ):
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="serving-grpc"),
            options=[("grpc.max_receive_message_length", MAX_BODY_BYTES),
                     # the answer's values, and room for its names and parameters
                     ("grpc.max_send_message_length", MAX_RESPONSE_BYTES + (1 << 20)),
                     ("grpc.so_reuseport", 0)],  # a port in use is an error, not shared
        )  # fmt: skip
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            _Service(frontend), self._server
        )
        self.port = self._bind(host, port)
        self._server.start()

    def _bind(self, host: str, port: int) -> int:
        """The port bound; one taken is a ConfigError naming the flag. grpcio says only that
        binding failed, so the port is first tried by a socket of this process, which says
        why (a port taken between the two is reported without the reason)."""
        if port != 0:
            try:
                socket.create_server((host, port)).close()
            except OSError as error:
                self._server.stop(None)
                raise ConfigError(cannot_listen("gRPC", "--grpc-port", host, port, error)) from None
        try:
            bound = int(self._server.add_insecure_port(f"{host}:{port}"))
        except RuntimeError:  # grpcio raises it where the port is in use
            bound = 0
        if bound == 0:  # older grpcio returns 0 instead
            self._server.stop(None)
            raise ConfigError(
                f"gRPC cannot listen on {host}:{port}: check --host and --grpc-port (0: a free one)"
            )
        return bound

    def close(self) -> None:
        self._server.stop(grace=1.0).wait(5.0)
