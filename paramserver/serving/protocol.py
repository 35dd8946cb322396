"""The Open Inference Protocol (KServe v2) as serving speaks it, apart from its transports.

Serving answers for several models: ``model`` (the user's model whole: its inputs are the
forward's tensor arguments in order, named as the forward names them; its outputs what the
forward returns, ``output`` or ``output_0``, ``output_1``... for a tuple) and one per table
(``emb.weight``: input ``ids``, INT64 of any shape; output ``rows``, the rows of those ids,
of shape ``ids.shape + [dim]``). Every answer names the served version in its parameters
(``served_version``, and ``steps``: each training server's last step applied, as
``server:step`` pairs).

A request is checked whole before anything runs: the model exists, the inputs are exactly the
model's, each with its datatype, a shape that fits, and as many values as the shape says, at
most :data:`MAX_ELEMENTS` of them. Anything else is a :class:`ProtocolError` with the status
each transport maps it to (HTTP 400 or 404, gRPC INVALID_ARGUMENT or NOT_FOUND); serving is
unchanged by it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paramserver.errors import InvalidBatchError, ParamServerError
from paramserver.serving.model import ServedModel, Version

MAX_ELEMENTS = 1 << 22  # values of one input: a lookup of 4M ids is a mistake, not a batch
WHOLE_MODEL = "model"

DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}


class ProtocolError(ParamServerError):
    """A request the protocol refuses; ``not_found``: it names no model this server has."""

    def __init__(self, message: str, *, not_found: bool = False):
        super().__init__(message)
        self.not_found = not_found


@dataclass(frozen=True)
class TensorSpec:
    """An input or output as metadata gives it: -1 where a dimension may be anything."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def datatype_of(dtype: torch.dtype | np.dtype) -> str:
    """The protocol's name of a tensor's dtype."""
    as_numpy = (
        torch.empty(0, dtype=dtype).numpy().dtype if isinstance(dtype, torch.dtype) else dtype
    )
    if as_numpy not in _NAMES:
        raise ProtocolError(f"dtype {dtype} has no name in the protocol")
    return _NAMES[as_numpy]


class Endpoint:
    """One model of the protocol: its inputs and outputs, and how it answers."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": ["1"],
            "platform": "paramserver",
            "inputs": [spec.metadata() for spec in self.inputs],
            "outputs": [spec.metadata() for spec in self.outputs],
        }

    def infer(self, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Version]:
        raise NotImplementedError


class TableEndpoint(Endpoint):
    """Raw lookups of one table by id."""

    def __init__(self, served: ServedModel, table: str):
        spec = served.plan.tables[served.aliases.get(table, table)]
        self.served, self.name = served, table
        self.inputs = (TensorSpec("ids", "INT64", (-1,)),)
        self.outputs = (TensorSpec("rows", datatype_of(spec.dtype), (-1, spec.dim)),)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Version]:
        try:
            rows, version = self.served.lookup(self.name, torch.from_numpy(inputs["ids"]))
        except InvalidBatchError as error:
            raise ProtocolError(str(error)) from None
        return {"rows": rows.numpy()}, version


class ModelEndpoint(Endpoint):
    """The user's model whole: its forward on the inputs, in the forward's order."""

    def __init__(self, served: ServedModel, example: Sequence[Tensor], name: str = WHOLE_MODEL):
        self.served, self.name = served, name
        names = _argument_names(served.model, len(example))
        self.inputs = tuple(
            TensorSpec(arg, datatype_of(t.dtype), (-1, *t.shape[1:]))
            for arg, t in zip(names, example, strict=True)
        )
        outputs, _ = served.predict(list(example))
        self.output_names = _output_names(outputs)
        self.outputs = tuple(
            TensorSpec(out, datatype_of(t.dtype), (-1, *t.shape[1:]))
            for out, t in zip(self.output_names, _as_tuple(outputs), strict=True)
        )

    def infer(self, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], Version]:
        arguments = [torch.from_numpy(inputs[spec.name]) for spec in self.inputs]
        try:
            outputs, version = self.served.predict(arguments)
        except (IndexError, RuntimeError, ValueError, InvalidBatchError) as error:
            raise ProtocolError(
                f"model {self.name!r} cannot run on these inputs: {error}"
            ) from None
        tensors = _as_tuple(outputs)
        return {n: t.numpy() for n, t in zip(self.output_names, tensors, strict=True)}, version


def _argument_names(model: torch.nn.Module, count: int) -> list[str]:
    parameters = list(inspect.signature(model.forward).parameters.values())
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[:count] if len(named) >= count else [f"input_{i}" for i in range(count)]


def _as_tuple(outputs: Any) -> tuple[Tensor, ...]:
    found = outputs if isinstance(outputs, tuple | list) else (outputs,)
    if not all(isinstance(t, Tensor) for t in found):
        raise ProtocolError("the model's forward must return a tensor or a tuple of tensors")
    return tuple(t.detach().contiguous() for t in found)


def _output_names(outputs: Any) -> list[str]:
    count = len(_as_tuple(outputs))
    return (
        ["output"]
        if not isinstance(outputs, tuple | list)
        else [f"output_{i}" for i in range(count)]
    )


def checked_inputs(
    endpoint: Endpoint, given: Sequence[tuple[str, str, Sequence[int], Any]]
) -> dict[str, np.ndarray]:
    """The arrays of ``given`` (name, datatype, shape, values: an array, bytes or a list), each
    checked against ``endpoint``'s inputs (see the module doc)."""
    specs = {spec.name: spec for spec in endpoint.inputs}
    names = [name for name, *_ in given]
    if sorted(names) != sorted(specs):
        raise ProtocolError(
            f"model {endpoint.name!r} takes the inputs {sorted(specs)}, got {names}"
        )
    arrays = {}
    for name, datatype, shape, values in given:
        arrays[name] = _array(specs[name], datatype, shape, values)
    return arrays


def _array(spec: TensorSpec, datatype: str, shape: Sequence[int], values: Any) -> np.ndarray:
    where = f"input {spec.name!r}"
    if datatype != spec.datatype:
        raise ProtocolError(f"{where} must be {spec.datatype}, got {datatype}")
    if not (isinstance(shape, list | tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise ProtocolError(f"{where}: shape must be a list of integers >= 0, got {shape!r}")
    any_shape = spec.shape == (-1,) and spec.name == "ids"  # a table's ids: any shape
    if not any_shape and (
        len(shape) != len(spec.shape)
        or any(want not in (-1, got) for want, got in zip(spec.shape, shape, strict=True))
    ):
        raise ProtocolError(f"{where}: shape {list(shape)} does not fit {list(spec.shape)}")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise ProtocolError(f"{where}: {count} values, over the limit of {MAX_ELEMENTS}")
    dtype = DATATYPES[datatype]
    if isinstance(values, bytes | bytearray | memoryview):
        if len(values) != count * dtype.itemsize:
            raise ProtocolError(
                f"{where}: {len(values)} bytes for {count} {datatype} values of shape {list(shape)}"
            )
        return np.frombuffer(values, dtype=dtype).reshape(shape).copy()
    try:
        array = np.asarray(values, dtype=dtype).reshape(-1)
    except (TypeError, ValueError, OverflowError) as error:
        raise ProtocolError(f"{where}: values are not {datatype}: {error}") from None
    if array.size != count:
        raise ProtocolError(f"{where}: {array.size} values for shape {list(shape)}")
    return array.reshape(shape)


def version_parameters(version: Version) -> dict[str, Any]:
    """What an answer says of the version it read."""
    steps = ",".join(f"{server}:{step}" for server, step in sorted(version.steps.items()))
    return {"served_version": version.number, "steps": steps}
