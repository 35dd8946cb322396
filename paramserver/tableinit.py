"""Tables built without their memory: a table's initialisation is recorded while ``model_fn``
builds it on the meta device, and replayed for any set of rows.

A fixed table of 25M rows must start on four servers without any of them holding it whole.
While ``model_fn`` runs, :class:`TablesOnMeta` gives ``nn.Embedding`` and ``nn.EmbeddingBag``
weights on the meta device (no memory), and :class:`InitRecorder` writes down what is done to
them, in order: the layer's own ``reset_parameters`` and whatever ``model_fn`` does after it.
:class:`RowInit` replays that recipe for the rows a server owns, with random values that are a
pure function of (job seed, table name, recipe step, row, column), drawn from a counter-based
generator (SplitMix64): the same on every server and in the single-process reference, whatever
the number of servers.

What replays row by row, and keeps its distribution and parameters:

- ``normal_``, ``uniform_``, ``trunc_normal_``, ``constant_``, ``zeros_``, ``ones_``, and the
  ``xavier_*`` and ``kaiming_*`` initialisers (uniform or normal with bounds from the shape);
- ``fill_``, ``zero_``, arithmetic by a number (``mul_``, ``add_``, ``sub_``, ``div_``),
  ``clamp_``, ``erfinv_``;
- a row set to a number (``nn.Embedding``'s ``padding_idx`` row);
- values ``model_fn`` gives: ``copy_`` from a tensor it built, ``from_pretrained``, ``_weight``
  (held as given; their rows are taken from that tensor).

Anything else done to a table's weight (an op that is not in this list, a view of part of it)
cannot be replayed: :func:`paramserver.modelplan.build_model` then builds the model whole once
and takes that table's values from it, logging which table, why, and the memory it takes.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import init
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from paramserver.hashing import mix64_array

CHUNK_VALUES = 1 << 18  # values generated at a time: bounds the generator's scratch memory
_OVERWRITING = frozenset({"normal", "uniform", "trunc_normal", "fill", "copy"})


@dataclass(frozen=True)
class Step:
    """One recorded operation on a table's weight, replayed in order.

    ``op`` is one of ``normal`` (mean, std), ``uniform`` (low, high), ``trunc_normal`` (mean,
    std, low, high), ``fill`` (value), ``mul``/``add`` (number), ``clamp`` (min, max: NaN for
    none), ``erfinv`` or ``copy`` (``source``: the whole table's values or one row's). A step
    with a ``row`` applies to that row only."""

    op: str
    args: tuple[float, ...] = ()
    row: int | None = None
    source: Tensor | None = field(default=None, compare=False)


class RowInit:
    """A fixed table's initial values, row by row: ``rows(ids)`` is the same for any set of
    ids, in any process."""

    def __init__(
        self, table: str, shape: tuple[int, int], dtype: torch.dtype, steps: list[Step], seed: int
    ):
        self.table = table
        self.shape = shape
        self.dtype = dtype
        self.steps = steps
        # Steps before the last one that sets every value cannot change the result: skipped.
        overwrites = [i for i, s in enumerate(steps) if s.row is None and s.op in _OVERWRITING]
        self._first_step = overwrites[-1] if overwrites else 0
        self.key = int(mix64_array(np.array([seed], dtype=np.int64))[0]) ^ _name_key(table)

    @classmethod
    def given(cls, table: str, values: Tensor) -> RowInit:
        """Rows taken from ``values``, a whole table ``model_fn`` built itself."""
        rows, dim = values.shape
        return cls(table, (rows, dim), values.dtype, [Step("copy", source=values.detach())], 0)

    def rows(self, ids: Tensor) -> Tensor:
        """The initial values of rows ``ids`` (int64, any order)."""
        out = torch.empty(ids.numel(), self.shape[1], dtype=self.dtype)
        self.fill(out, ids)
        return out

    def fill(self, out: Tensor, ids: Tensor) -> None:
        """Write the initial values of rows ``ids`` into ``out`` (``[len(ids), dim]``), a chunk
        at a time."""
        chunk_rows = max(1, CHUNK_VALUES // self.shape[1])
        for start in range(0, ids.numel(), chunk_rows):
            chunk = ids[start : start + chunk_rows]
            out[start : start + chunk.numel()] = self._chunk(chunk)

    def _chunk(self, ids: Tensor) -> Tensor:
        working = torch.float64 if self.dtype == torch.float64 else torch.float32
        values = torch.zeros(ids.numel(), self.shape[1], dtype=working)
        for index, step in enumerate(self.steps[self._first_step :], start=self._first_step):
            if step.row is None:
                values = _apply(step, values, ids, self.key + index).to(working)
            else:
                hit = ids == step.row
                if bool(hit.any()):
                    values[hit] = _apply(step, values[hit], ids[hit], self.key + index).to(working)
        return values.to(self.dtype)


def _apply(step: Step, values: Tensor, ids: Tensor, key: int) -> Tensor:
    args = step.args
    if step.op == "normal":
        return _standard_normal(key, ids, values.shape[1]).mul_(args[1]).add_(args[0])
    if step.op == "uniform":
        return _unit(key, ids, values.shape[1]).mul_(args[1] - args[0]).add_(args[0])
    if step.op == "trunc_normal":
        return _trunc_normal(key, ids, values.shape[1], *args)
    if step.op == "fill":
        return values.fill_(args[0])
    if step.op == "mul":
        return values.mul_(args[0])
    if step.op == "add":
        return values.add_(args[0])
    if step.op == "clamp":
        low, high = (None if math.isnan(a) else a for a in args)
        return values.clamp_(low, high)
    if step.op == "erfinv":
        return values.erfinv_()
    assert step.op == "copy" and step.source is not None, step
    source = step.source if step.row is not None else step.source[ids]
    return source.to(values.dtype).expand_as(values).clone()


def _name_key(table: str) -> int:
    """A 64-bit key of the table's name (the same in every process, unlike ``hash``)."""
    digest = hashlib.blake2b(table.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _bits(key: int, ids: Tensor, dim: int) -> np.ndarray:
    """64 well-mixed bits per (row, column): a hash of the row's hash and the column."""
    rows = mix64_array(ids.numpy().astype(np.int64) ^ np.int64(key))
    columns = mix64_array(np.arange(dim, dtype=np.int64) + np.int64(key))
    return mix64_array(rows[:, None] ^ columns[None, :])


def _unit(key: int, ids: Tensor, dim: int) -> Tensor:
    """Uniform in [0, 1), 24 bits per value."""
    bits = (_bits(key, ids, dim) >> 40) & 0xFFFFFF
    return torch.from_numpy(bits.astype(np.float32) * np.float32(2.0**-24))


def _standard_normal(key: int, ids: Tensor, dim: int) -> Tensor:
    """N(0, 1) by Box-Muller on two 24-bit uniforms of one 64-bit hash."""
    bits = _bits(key, ids, dim)
    radius_unit = ((bits >> 40) & 0xFFFFFF).astype(np.float32) + np.float32(1.0)  # (0, 1]
    angle_unit = ((bits >> 16) & 0xFFFFFF).astype(np.float32)
    radius = np.sqrt(np.float32(-2.0) * np.log(radius_unit * np.float32(2.0**-24)))
    return torch.from_numpy(radius * np.cos(angle_unit * np.float32(2 * math.pi * 2.0**-24)))


def _trunc_normal(
    key: int, ids: Tensor, dim: int, mean: float, std: float, low: float, high: float
) -> Tensor:
    """N(mean, std²) cut to [low, high], by inverting the normal CDF on a uniform draw."""
    cdf_low = _normal_cdf((low - mean) / std)
    cdf_high = _normal_cdf((high - mean) / std)
    unit = _unit(key, ids, dim).to(torch.float64) * (cdf_high - cdf_low) + cdf_low
    values = torch.erfinv(unit.mul_(2).sub_(1)).mul_(std * math.sqrt(2.0)).add_(mean)
    return values.clamp_(low, high).to(torch.float32)


def _normal_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


# ---- recording ----


class TablesOnMeta(TorchFunctionMode):
    """While active (in this thread), ``nn.Embedding`` and ``nn.EmbeddingBag`` allocate their
    weights on the meta device: a model's structure without its tables' memory.

    A meta tensor moved to another device stays on the meta device, with the dtype asked for:
    a constructor that ends with ``self.to(device)`` (a habit of CTR libraries) then builds
    without its tables' memory too. Values given by setting a meta weight's ``data`` (as
    facebookresearch/dlrm gives numpy's) are copied in instead, which the recorder records as
    given values, so the weight stays on the meta device."""

    TABLE_INITS = frozenset({nn.Embedding.__init__.__code__, nn.EmbeddingBag.__init__.__code__})
    FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn})
    MOVES = frozenset({Tensor.to, Tensor.cpu, Tensor.cuda})

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None and _in_table_init():
            kwargs = {**kwargs, "device": "meta"}
        elif func in self.MOVES and args and isinstance(args[0], Tensor) and args[0].is_meta:
            return _kept_on_meta(func, args[0], args[1:], kwargs)
        elif _sets_data(func) and _values_for_meta(args):
            with torch.no_grad():
                args[0].copy_(args[1])
            return None
        return func(*args, **kwargs)


_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor of Tensor.data


def _sets_data(func: Any) -> bool:
    """Whether ``func`` is ``Tensor.data``'s setter (a new method-wrapper at each access)."""
    return getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__"


def _values_for_meta(args: Any) -> bool:
    """Whether ``weight.data = values`` gives a meta weight values of its own shape."""
    if len(args) != 2 or not all(isinstance(a, Tensor) for a in args):
        return False
    weight, values = args
    return weight.is_meta and not values.is_meta and weight.shape == values.shape


def _kept_on_meta(move: Any, tensor: Tensor, args: Any, kwargs: dict) -> Tensor:
    """``tensor`` (on the meta device) as ``move`` would return it, left on the meta device."""
    dtype = None
    if move is Tensor.to:
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if args and isinstance(args[0], Tensor):  # to(other): other's dtype
            dtype = args[0].dtype
    return tensor if dtype in (None, tensor.dtype) else tensor.to(dtype=dtype)


def _in_table_init() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in TablesOnMeta.TABLE_INITS:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@dataclass
class _Written:
    """One in-place operation on a meta storage: the step it is (None: not replayable), and
    the geometry of the tensor it wrote, to tell the whole table from one of its rows."""

    step: Step | None
    what: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class Recording:
    """What was done to one table's weight: its steps, or why they cannot be replayed."""

    steps: list[Step] = field(default_factory=list)
    unreplayable: str | None = None


class InitRecorder(TorchDispatchMode):
    """While active, records every in-place operation on a meta tensor, by its storage."""

    def __init__(self) -> None:
        super().__init__()
        self._written: dict[int, list[_Written]] = {}
        self._storages: list[Tensor] = []  # held, so that no storage key is reused

    def of(self, weight: Tensor) -> Recording:
        """What was done to ``weight`` (a 2-D meta tensor), in order."""
        recording = Recording()
        for written in self._written.get(_storage_key(weight), []):
            row = _row_of(written, weight)
            if written.step is None or row == -1:
                recording.unreplayable = f"{written.what} on {_region(row)}"
                return recording
            recording.steps.append(
                Step(written.step.op, written.step.args, row, written.step.source)
            )
        return recording

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for position, target in _written_arguments(func, args):
            if isinstance(target, Tensor) and target.is_meta:
                step = _step_of(func, args, kwargs) if position == 0 else None
                self.write(target, step, str(func))
        if func is _NORMAL and args[0].is_meta:
            # Nothing to compute; torch's own path for it imports torch._dynamo (~1 s).
            return args[0]
        return func(*args, **kwargs)

    def write(self, target: Tensor, step: Step | None, what: str) -> None:
        self._storages.append(target)
        self._written.setdefault(_storage_key(target), []).append(
            _Written(step, what, int(target.storage_offset()), tuple(target.shape), target.stride())
        )


def _spare_the_dynamo_import(mode: type[TorchDispatchMode]) -> None:
    """torch wraps each dispatch mode's ``__torch_dispatch__`` so that torch.compile leaves it
    alone, and the wrapper imports torch._dynamo at its first call: about a second of CPU at
    the start of every process that builds a model. A mode active only while a model is
    built runs nothing compiled, so it is marked as wrapped already (where torch's wrapper
    is the one this knows; otherwise nothing changes)."""
    original = getattr(mode.__dict__["__torch_dispatch__"], "__wrapped__", None)
    if original is not None:
        original.__dynamo_disable = original


_spare_the_dynamo_import(InitRecorder)
_NORMAL = torch.ops.aten.normal_.default


def _storage_key(tensor: Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _written_arguments(func: Any, args: Any) -> Iterator[tuple[int, Any]]:
    for position, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is not None and info.is_write and position < len(args):
            yield position, args[position]


def _row_of(written: _Written, whole: Tensor) -> int | None:
    """None where the write covered ``whole``; the row it wrote where it was one row; -1
    otherwise."""
    whole_geometry = (tuple(whole.shape), whole.stride(), 0)
    if (written.shape, written.stride, written.offset) == whole_geometry:
        return None
    dim = whole.shape[1]
    if written.shape == (dim,) and written.stride == (1,) and written.offset % dim == 0:
        return written.offset // dim
    return -1


def _region(row: int | None) -> str:
    return "the whole table" if row is None else ("a row" if row >= 0 else "part of the table")


_SCALARS = (int, float, bool)


def _number(value: Any) -> float | None:
    if isinstance(value, _SCALARS):
        return float(value)
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_meta:
        return float(value.item())
    return None


_DRAWS = {"normal_": ("mean", "std"), "uniform_": ("from", "to")}


def _step_of(func: Any, args: Any, kwargs: dict) -> Step | None:
    """The replayable step an in-place ``func`` on a table's weight is, or None."""
    name = func.overloadpacket.__name__
    if name in _DRAWS:
        low, high = (
            _argument(args, kwargs, 1 + i, key, 1.0 * i) for i, key in enumerate(_DRAWS[name])
        )
        return Step(name.rstrip("_"), (low, high))
    if name == "zero_":
        return Step("fill", (0.0,))
    if name == "erfinv_":
        return Step("erfinv")
    if name == "copy_":
        source = args[1]
        usable = isinstance(source, Tensor) and not source.is_meta
        return Step("copy", source=source.detach().clone()) if usable else None
    if name == "clamp_":
        return _clamp([_argument(args, kwargs, 1, "min"), _argument(args, kwargs, 2, "max")])
    if name in ("clamp_min_", "clamp_max_"):
        bound = _argument(args, kwargs, 1, name[6:9])
        return _clamp([bound, None] if name == "clamp_min_" else [None, bound])
    return _arithmetic(name, [_number(a) for a in args[1:]], kwargs)


def _argument(args: Any, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _clamp(bounds: list[Any]) -> Step | None:
    numbers = [math.nan if b is None else _number(b) for b in bounds]
    if any(n is None for n in numbers):
        return None
    return Step("clamp", tuple(n for n in numbers if n is not None))


def _arithmetic(name: str, operands: list[float | None], kwargs: dict) -> Step | None:
    """``fill_``, ``mul_``, ``div_``, ``add_`` or ``sub_`` by a number, as a step."""
    number = operands[0] if operands else None
    if number is None:
        return None
    if name == "fill_":
        return Step("fill", (number,))
    if name == "mul_":
        return Step("mul", (number,))
    if name == "div_" and kwargs.get("rounding_mode") is None and number != 0:
        return Step("mul", (1.0 / number,))
    if name in ("add_", "sub_"):
        scaled = number * float(kwargs.get("alpha", 1.0))
        return Step("add", (scaled if name == "add_" else -scaled,))
    return None


# nn.init functions that return before any operation when given a meta tensor: invisible to
# both modes, so their calls are watched (a profile hook sees a call however it was imported).
_RETURN_ON_META = {
    init.trunc_normal_.__code__: "trunc_normal_",
    init.orthogonal_.__code__: "orthogonal_",
    init.dirac_.__code__: "dirac_",
    init.sparse_.__code__: "sparse_",
}


class RecordingTables:
    """Both modes for one build in this thread, and a watch on the ``nn.init`` functions that
    skip meta tensors (``trunc_normal_`` is recorded, the others cannot be replayed)."""

    def __init__(self) -> None:
        self.recorder = InitRecorder()
        self._meta = TablesOnMeta()

    def __enter__(self) -> InitRecorder:
        self._previous_profile = sys.getprofile()
        sys.setprofile(self._on_event)
        self._meta.__enter__()
        self.recorder.__enter__()
        return self.recorder

    def __exit__(self, *exc: object) -> None:
        self.recorder.__exit__(*exc)
        self._meta.__exit__(*exc)
        sys.setprofile(self._previous_profile)

    def _on_event(self, frame: FrameType, event: Any, arg: Any) -> None:
        if self._previous_profile is not None:
            self._previous_profile(frame, event, arg)
        name = _RETURN_ON_META.get(frame.f_code) if event == "call" else None
        if name is None:
            return
        tensor = frame.f_locals.get("tensor")
        if not (isinstance(tensor, Tensor) and tensor.is_meta):
            return
        step = None
        if name == "trunc_normal_":
            bounds = tuple(float(frame.f_locals[k]) for k in ("mean", "std", "a", "b"))
            step = Step("trunc_normal", bounds)
        self.recorder.write(tensor, step, name)
