"""The Open Inference Protocol (KServe v2) as serving speaks it, apart from its transports.

Serving answers for several models: ``model`` (the user's model whole: its inputs are the
forward's tensor arguments in order, named as the forward names them; its outputs what the
forward returns, ``output`` or ``output_0``, ``output_1``... for a tuple) and one per table
(``emb.weight``: input ``ids``, INT64 of shape ``[-1]``, a list; output ``rows``, the rows of
those ids, of shape ``[-1, dim]``, in the table's dtype: a bfloat16 table answers BF16, which
tritonclient reads as ``ml_dtypes.bfloat16``). Every input is taken in the shape its metadata
declares, and only in it: the protocol's shapes have no way to say "any number of
dimensions" (ids of a batch of sequences are sent flat, their rows reshaped by the client).
Every answer names the served version in its parameters (``served_version``, a number that
only rises for a given log: see :attr:`~paramserver.serving.model.Version.number`; and
``steps``: each training server's last step applied, as ``server:step`` pairs).

A request is checked whole before anything runs: the model exists, the inputs are exactly the
model's, each with its datatype, a shape of at most :data:`MAX_RANK` dimensions that fits, and
as many values as the shape says (raw bytes: exactly as many bytes; listed: numbers of the
datatype's kind, finite, in its range), at most :data:`MAX_ELEMENTS` of them, counted before
anything is allocated; the outputs asked for are the model's. An answer is bounded too: one
over :data:`MAX_RESPONSE_BYTES` (a listed value counted as :data:`JSON_VALUE_BYTES`) is refused
instead of built, a lookup's before it reads a row. Anything else is a :class:`ProtocolError`
with the status each transport maps it to (HTTP 400 or 404, gRPC INVALID_ARGUMENT, NOT_FOUND
or, for an answer too large, RESOURCE_EXHAUSTED); serving is unchanged by it.

Tensors cross this module as torch tensors (numpy has no bfloat16).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paramserver.errors import InvalidBatchError, ParamServerError
from paramserver.serving.model import ServedModel, Version

MAX_RANK = 8
MAX_ELEMENTS = 1 << 22  # values of one input: a lookup of 4M ids is a mistake, not a batch
MAX_RESPONSE_BYTES = 64 << 20
JSON_VALUE_BYTES = 25  # the longest a listed value gets: '-2.2250738585072014e-308,'
WHOLE_MODEL = "model"

DATATYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}


class ProtocolError(ParamServerError):
    """A request the protocol refuses; ``not_found``: it names no model this server has;
    ``too_large``: its answer would be over :data:`MAX_RESPONSE_BYTES`."""

    def __init__(self, message: str, *, not_found: bool = False, too_large: bool = False):
        super().__init__(message)
        self.not_found, self.too_large = not_found, too_large


@dataclass(frozen=True)
class TensorSpec:
    """An input or output as metadata gives it: -1 where a dimension may be anything."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass(frozen=True)
class Requested:
    """An output a request asks for; ``raw``: as bytes (else as a list of values)."""

    name: str
    raw: bool = True


def datatype_of(dtype: torch.dtype) -> str:
    """The protocol's name of a tensor's dtype."""
    if dtype not in _NAMES:
        raise ProtocolError(f"dtype {dtype} has no name in the protocol")
    return _NAMES[dtype]


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: a client's value quoted in an error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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

    def answer_sizes(self, inputs: Mapping[str, Tensor]) -> dict[str, tuple[int, int]]:
        """Each output's values and bytes per value on ``inputs``, where known before it
        runs (the answer's size is checked then)."""
        return {}

    def infer(self, inputs: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Version]:
        raise NotImplementedError


class TableEndpoint(Endpoint):
    """Raw lookups of one table by id."""

    def __init__(self, served: ServedModel, table: str):
        self.spec = served.plan.tables[served.aliases.get(table, table)]
        self.served, self.name = served, table
        self.inputs = (TensorSpec("ids", "INT64", (-1,)),)
        self.outputs = (TensorSpec("rows", datatype_of(self.spec.dtype), (-1, self.spec.dim)),)

    def answer_sizes(self, inputs: Mapping[str, Tensor]) -> dict[str, tuple[int, int]]:
        return {"rows": (inputs["ids"].numel() * self.spec.dim, self.spec.dtype.itemsize)}

    def infer(self, inputs: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Version]:
        try:
            rows, version = self.served.lookup(self.name, inputs["ids"])
        except InvalidBatchError as error:
            raise ProtocolError(str(error)) from None
        return {"rows": rows}, version


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

    def infer(self, inputs: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Version]:
        arguments = [inputs[spec.name] for spec in self.inputs]
        try:  # an id outside a table's rows: InvalidBatchError naming its input and table
            outputs, version = self.served.predict(arguments, [s.name for s in self.inputs])
        except (IndexError, RuntimeError, ValueError, InvalidBatchError) as error:
            raise ProtocolError(
                f"model {self.name!r} cannot run on these inputs: {error}"
            ) from None
        tensors = _as_tuple(outputs)
        return dict(zip(self.output_names, tensors, strict=True)), version


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


# ---- requests checked ----


def checked_inputs(
    endpoint: Endpoint, given: Sequence[tuple[str, Any, Any, Any]]
) -> dict[str, Tensor]:
    """The tensors of ``given`` (name, datatype, shape, values: bytes or a list, nested or
    not), each checked against ``endpoint``'s inputs (see the module doc)."""
    specs = {spec.name: spec for spec in endpoint.inputs}
    names = [name for name, *_ in given]
    if sorted(names) != sorted(specs):
        raise ProtocolError(
            f"model {endpoint.name!r} takes the inputs {sorted(specs)}, got {brief(names)}"
        )
    return {name: _tensor(specs[name], *rest) for name, *rest in given}


def checked_outputs(endpoint: Endpoint, requested: Sequence[Requested]) -> list[Requested]:
    """``requested``, each an output of ``endpoint``'s."""
    names = [spec.name for spec in endpoint.outputs]
    for output in requested:
        if output.name not in names:
            raise ProtocolError(
                f"model {endpoint.name!r} has no output {brief(output.name)}; its outputs "
                f"are {names}"
            )
    return list(requested)


def _tensor(spec: TensorSpec, datatype: Any, shape: Any, values: Any) -> Tensor:
    where = f"input {spec.name!r}"
    if datatype not in DATATYPES:
        raise ProtocolError(f"{where}: datatype {brief(datatype)} is none of {list(DATATYPES)}")
    if datatype != spec.datatype:
        raise ProtocolError(f"{where} must be {spec.datatype}, got {datatype}")
    count = _count(where, spec, shape)
    dtype = DATATYPES[datatype]
    if isinstance(values, bytes | bytearray | memoryview):
        return _from_bytes(where, dtype, shape, count, values)
    return _from_values(where, datatype, shape, count, values).reshape(shape)


def _count(where: str, spec: TensorSpec, shape: Any) -> int:
    """How many values ``shape`` holds, once it is found a shape that fits ``spec``, of at
    most MAX_ELEMENTS values."""
    if not isinstance(shape, list | tuple) or len(shape) > MAX_RANK:
        raise ProtocolError(f"{where}: shape must be a list of at most {MAX_RANK} integers, "
                            f"got {brief(shape)}")  # fmt: skip
    if not all(type(n) is int and n >= 0 for n in shape):  # no bools either
        raise ProtocolError(f"{where}: shape must be of integers >= 0, got {brief(shape)}")
    if len(shape) != len(spec.shape) or any(
        want not in (-1, got) for want, got in zip(spec.shape, shape, strict=True)
    ):
        raise ProtocolError(
            f"{where}: shape {brief(shape)} does not fit {list(spec.shape)} (-1: any size)"
        )
    count = 1
    for n in shape:  # stopped at the first product over the limit: never 2**62 * 2**62 * ...
        count *= n
        if count > MAX_ELEMENTS:
            raise ProtocolError(
                f"{where}: shape {brief(shape)} is over the limit of {MAX_ELEMENTS} values"
            )
    return count


def _from_bytes(where: str, dtype: torch.dtype, shape: Sequence[int], count: int,
                values: bytes | bytearray | memoryview) -> Tensor:  # fmt: skip
    if len(values) != count * dtype.itemsize:
        raise ProtocolError(f"{where}: {len(values)} bytes for {count} {_NAMES[dtype]} values "
                            f"of shape {list(shape)}")  # fmt: skip
    raw = torch.from_numpy(np.frombuffer(values, dtype=np.uint8).copy())  # the body is not ours
    if dtype == torch.bool and raw.numel() and int(raw.max()) > 1:
        raise ProtocolError(f"{where}: BOOL bytes must be 0 or 1")
    return raw.view(dtype).reshape(shape)


def _from_values(where: str, datatype: str, shape: Sequence[int], count: int,
                 values: Any) -> Tensor:  # fmt: skip
    flat = _flat(where, values)
    if len(flat) != count:
        raise ProtocolError(f"{where}: {len(flat)} values for shape {list(shape)}")
    dtype = DATATYPES[datatype]
    kinds, noun = (
        ({bool}, "booleans") if dtype == torch.bool
        else ({int, float}, "numbers") if dtype.is_floating_point
        else ({int}, "integers")
    )  # fmt: skip
    others = set(map(type, flat)) - kinds  # bool is not int here: JSON tells them apart
    if others:
        raise ProtocolError(f"{where}: {datatype} values must be {noun}, got "
                            f"{sorted(t.__name__ for t in others)}")  # fmt: skip
    try:
        tensor = torch.tensor(flat, dtype=dtype)
    except (OverflowError, RuntimeError, ValueError) as error:  # torch says each, by dtype
        raise ProtocolError(f"{where}: values out of {datatype}'s range: {error}") from None
    if dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
        raise ProtocolError(f"{where}: {datatype} values must be finite and in its range")
    return tensor


def _flat(where: str, values: Any, depth: int = 0) -> list[Any]:
    """``values``, a list nested at most MAX_RANK deep, as one flat list."""
    if not isinstance(values, list) or depth > MAX_RANK:
        raise ProtocolError(
            f"{where}: data must be a list of values, nested at most {MAX_RANK} deep"
        )
    if list not in set(map(type, values)):  # the usual case: flat already, checked in C
        return values
    flat = []
    for value in values:
        flat.extend(_flat(where, value, depth + 1) if isinstance(value, list) else [value])
    return flat


# ---- answers ----


def raw_bytes(tensor: Tensor) -> bytes:
    """``tensor``'s values as the protocol's binary data: row-major, native byte order."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def version_parameters(version: Version) -> dict[str, Any]:
    """What an answer says of the version it read."""
    steps = ",".join(f"{server}:{step}" for server, step in sorted(version.steps.items()))
    return {"served_version": version.number, "steps": steps}
