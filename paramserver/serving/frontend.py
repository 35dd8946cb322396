"""What every transport of serving shares: the models it answers for, and each answer counted.

The HTTP and gRPC transports (:mod:`paramserver.serving.http`, :mod:`paramserver.serving.grpc`)
turn their requests into :meth:`Frontend.infer` calls and its answers and errors into their own
messages; nothing here knows a transport. A request's path: find the model, check the inputs
and the outputs asked for, check the answer's size where it is known before running, run,
check the answer's size (see :mod:`paramserver.serving.protocol`). An answer too large is
refused with what each transport's client can do about it: ask for fewer ids (or rows) per
request, and, over HTTP, where outputs were asked for as JSON and would fit as binary data,
ask for them so (gRPC's answers are binary already).
"""

from __future__ import annotations

import errno
import importlib.metadata
import logging
import time
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from paramserver.serving import protocol as oip
from paramserver.serving.metrics import ServingMetrics
from paramserver.serving.model import ServedModel, Version
from paramserver.serving.protocol import (
    WHOLE_MODEL,
    Endpoint,
    ModelEndpoint,
    ProtocolError,
    Requested,
    TableEndpoint,
    brief,
    checked_inputs,
    checked_outputs,
)

log = logging.getLogger(__name__)

SERVER_NAME = "paramserver"


class Frontend:
    """The models of ``served`` as the protocol names them: the whole model (where
    ``example`` inputs say its inputs' types and shapes) under ``model_name``, and every
    table under each of its names."""

    def __init__(
        self,
        served: ServedModel,
        example: Sequence[Tensor] | None = None,
        model_name: str = WHOLE_MODEL,
    ):
        self.served = served
        self.metrics = ServingMetrics()
        self.ready = False  # set once the base is loaded
        self.endpoints: dict[str, Endpoint] = {}
        for table in [*served.plan.tables, *served.aliases]:
            self.endpoints[table] = TableEndpoint(served, table)
        if example is not None:
            if model_name in self.endpoints:
                raise ProtocolError(f"--model-name {model_name!r} is also a table's name")
            self.endpoints[model_name] = ModelEndpoint(served, example, model_name)

    def endpoint(self, name: str) -> Endpoint:
        found = self.endpoints.get(name)
        if found is None:
            raise ProtocolError(
                f"no model {brief(name)}; this server has {sorted(self.endpoints)}", not_found=True
            )
        return found

    def server_metadata(self) -> dict[str, Any]:
        return {
            "name": SERVER_NAME,
            "version": importlib.metadata.version("paramserver"),
            "extensions": ["binary_tensor_data"],
        }

    def infer(
        self,
        protocol: str,
        model: str,
        given: Sequence[tuple[str, Any, Any, Any]],
        requested: Sequence[Requested] = (),
        raw: bool = True,
    ) -> tuple[Endpoint, list[tuple[Requested, Tensor]], Version]:
        """``model``'s answer to inputs ``given`` (see
        :func:`~paramserver.serving.protocol.checked_inputs`): each output ``requested`` (all,
        each ``raw`` or not, where none is), counted under ``protocol``."""
        start = time.perf_counter()
        outcome = "error"
        try:
            endpoint = self.endpoint(model)
            inputs = checked_inputs(endpoint, given)
            wanted = checked_outputs(
                endpoint, requested or [Requested(spec.name, raw) for spec in endpoint.outputs]
            )
            sizes = endpoint.answer_sizes(inputs)
            check_answer_size(protocol, endpoint, wanted, sizes)  # a lookup's: before it runs
            outputs, version = endpoint.infer(inputs)
            sizes = {name: (t.numel(), t.element_size()) for name, t in outputs.items()}
            check_answer_size(protocol, endpoint, wanted, sizes)  # a prediction's: once it ran
            outcome = "ok"
            return endpoint, [(output, outputs[output.name]) for output in wanted], version
        except ProtocolError as error:
            outcome = (
                "not_found" if error.not_found else "too_large" if error.too_large
                else "bad_request"
            )  # fmt: skip
            raise
        finally:
            counted = model if model in self.endpoints else "(unknown)"
            self.metrics.request(protocol, counted, outcome, time.perf_counter() - start)


def check_answer_size(
    protocol: str,
    endpoint: Endpoint,
    requested: Sequence[Requested],
    sizes: dict[str, tuple[int, int]],
) -> None:
    """Refuse an answer of ``requested`` over
    :data:`~paramserver.serving.protocol.MAX_RESPONSE_BYTES` bytes, given the values and bytes
    per value of each output whose size is known (the others counted as nothing), saying what
    a client of ``protocol`` (``http`` or ``grpc``) can ask for instead."""
    limit, listed, binary = oip.MAX_RESPONSE_BYTES, 0, 0
    for output in requested:
        values, itemsize = sizes.get(output.name, (0, 0))
        listed += values * (itemsize if output.raw else oip.JSON_VALUE_BYTES)
        binary += values * itemsize
    if listed <= limit:
        return
    mib = f" ({limit >> 20} MiB)" if limit % (1 << 20) == 0 else ""
    fewer = "ids" if isinstance(endpoint, TableEndpoint) else "rows (a smaller batch)"
    message = (
        f"model {endpoint.name!r}: an answer of {listed} bytes is over the limit of {limit} "
        f"bytes{mib}; ask for fewer {fewer} per request"
    )
    if protocol == "http" and binary < listed and binary <= limit:
        message += f", or for the outputs as binary data (the answer would be {binary} bytes)"
    raise ProtocolError(message, too_large=True)


def cannot_listen(transport: str, flag: str, host: str, port: int, error: OSError) -> str:
    """One line saying why ``transport`` cannot listen on ``host``:``port``, and which flag
    changes it."""
    if error.errno == errno.EADDRINUSE:
        return (f"{transport} port {port} on {host} is in use by another process: stop it, or "
                f"give serve another {flag} (0: a free one)")  # fmt: skip
    if error.errno == errno.EACCES:
        return (f"{transport} port {port} needs privileges this process lacks: give serve "
                f"another {flag} (above 1023)")  # fmt: skip
    reason = error.strerror or str(error)
    return f"cannot listen for {transport} on {host}:{port} ({reason}): check --host and {flag}"
