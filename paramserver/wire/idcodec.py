"""Row ids on the wire: a sorted set of ids as its first id and the steps between them, in the
narrowest integer type that holds the largest step.

Every request names the rows it pushes and the rows it pulls by global id. As int64 an id costs
8 bytes, an eighth of the 64 bytes of a float32 row of 16 and nearly half of an int8 one. The
ids a message names for one table are sorted and unique, and close together: on the default
job a server's share of a table's ids in a step is about 137 of its 50,000 rows, a few hundred
ids apart. Their steps fit an int16, so an id costs about 2 bytes; no encoding of such a set
can go below ``log2 C(N, k)`` bits for ``k`` ids out of the ``N`` rows a server holds (1.24
bytes an id there; ``benchmarks/bench_comm.py`` reports both).

Format (:class:`PackedIds`): ``first``, a Python int, and ``steps``, a 1-D tensor with one entry
per id, such that ``ids[i] = first + steps[0] + ... + steps[i]``; :func:`compact_ids` writes
``first = ids[0]`` and ``steps[0] = 0``. The dtype is the narrowest of uint8, int16 and int32
that holds the largest step (int16 and int32 rather than uint16 and uint32, which torch 2.13
cannot unpickle). Where the steps need more than int32 (ids spread over the whole int64 space,
as hashed ids of a dynamic table are), :func:`compact_ids` returns the int64 ids themselves:
int64 steps would cost more than the ids. So a message carries ids as a plain int64 tensor or as
a :class:`PackedIds`, and a receiver takes either.

A receiver must not trust a peer's :class:`PackedIds`: :func:`packed_problem` says what is
wrong with one without raising (the type of each field, a step's dtype, a negative step, a
repeated or unsorted id, an id past int64), and :func:`unpack_ids` is safe on any it accepted.
What the unpacked ids must be (in a table's range, routed to this server) is the receiver's to
check, as for plain ids. Unpacked, ``n`` ids take ``8 n`` bytes: :func:`num_ids` lets a server
count them against its size cap before it unpacks anything.

A trainer sends the ids of every table of a call to one server packed together, as a
:class:`PackedTables`: each table's first id in one int64 tensor, its count and step type in
one int32 tensor, and every table's steps (or int64 ids) in one byte tensor. A per-table object
costs more to make, pickle and check than its few hundred bytes of steps; these three tensors
are made in one compiled call (:func:`pack_tables`), and a server unpacks and checks all of
them in one (:func:`unpack_tables`, which never raises on a peer's: it says what is wrong and
with which table). A peer's ids packed a table at a time are checked and unpacked together
too (:func:`unpack_all`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from paramserver import native

STEP_DTYPES = (torch.uint8, torch.int16, torch.int32)  # narrowest first
FIRST_NBYTES = 8  # ``first`` is counted on the wire as an int64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, eq=False)
class PackedIds:
    """Sorted unique int64 ids: ``first + steps.cumsum()`` (see the module docstring)."""

    first: int
    steps: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the steps, and ``first`` as an int64."""
        return FIRST_NBYTES + self.steps.numel() * self.steps.element_size()


def compact_ids(ids: Tensor) -> Tensor | PackedIds:
    """``ids`` (1-D int64, sorted, unique: a sender's own) as they travel: packed where the
    steps between them fit int32, else ``ids`` itself (then the caller must not modify ``ids``
    until the message is sent)."""
    if ids.numel() == 0:
        return PackedIds(0, torch.zeros(0, dtype=torch.uint8))
    if int(ids[-1]) - int(ids[0]) > _INT64_MAX:  # a step past int64: diff would wrap
        return ids
    steps = torch.diff(ids, prepend=ids[:1])
    largest = int(steps.max())
    for dtype in STEP_DTYPES:
        if largest <= torch.iinfo(dtype).max:
            return PackedIds(int(ids[0]), steps.to(dtype))
    return ids


def compact_all(parts: Sequence[Tensor]) -> list[Tensor | PackedIds]:
    """:func:`compact_ids` of each of ``parts`` (each 1-D int64, sorted, unique), the same
    results, in one call of the compiled loop over them all (a request's every table and
    server), else in a few numpy operations over them all."""
    packed: list[Tensor | PackedIds] = []
    found = native.pack_steps([part.numpy() for part in parts], _pack_by_numpy)
    for part, (first, dtype, steps) in zip(parts, found, strict=True):
        if dtype is None:  # steps past int32, or a span past int64: the ids themselves
            packed.append(part)
        else:
            packed.append(PackedIds(first, torch.from_numpy(steps)))
    return packed


def _pack_by_numpy(parts: Sequence[np.ndarray]) -> native.Packed:
    """:func:`paramserver.native.pack_steps`' result, by numpy."""
    sizes = [part.size for part in parts]
    if sum(sizes) == 0:
        return [(0, np.dtype(np.uint8), np.zeros(0, np.uint8)) for _ in parts]
    joined = np.concatenate(parts)
    steps = np.empty_like(joined)
    steps[0] = 0
    np.subtract(joined[1:], joined[:-1], out=steps[1:])  # across parts: reset below
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    live = [i for i, size in enumerate(sizes) if size]
    steps[starts[live]] = 0
    largest = dict(zip(live, np.maximum.reduceat(steps, starts[live]).tolist(), strict=True))
    packed: native.Packed = []
    for i, part in enumerate(parts):
        if not sizes[i]:
            packed.append((0, np.dtype(np.uint8), np.zeros(0, np.uint8)))
            continue
        start, end = int(starts[i]), int(ends[i])
        first = int(joined[start])
        # A span past int64 wrapped its steps: its ids go as they are, as compact_ids sends them.
        top = largest[i] if int(joined[end - 1]) - first <= _INT64_MAX else _INT64_MAX
        dtype = next((d for d, bound in _STEP_BOUNDS if top <= bound), None)
        packed.append((first, dtype, part if dtype is None else steps[start:end].astype(dtype)))
    return packed


_STEP_BOUNDS = [(np.dtype(str(d).removeprefix("torch.")), torch.iinfo(d).max) for d in STEP_DTYPES]


def unpack_ids(packed: PackedIds) -> Tensor:
    """The int64 ids ``packed`` stands for (a new tensor). Safe on any :class:`PackedIds`
    :func:`packed_problem` accepted; on others the result means nothing."""
    return packed.steps.to(torch.int64).cumsum(0).add_(packed.first)


def unpack_all(sets: Sequence[object]) -> tuple[list[Tensor], int]:
    """The int64 ids each of ``sets`` (a peer's :class:`PackedIds`) stands for, views of one
    new tensor, and the place of the first that :func:`packed_problem` refuses (-1: none; the
    ids mean nothing then): every set checked and unpacked in one call of the compiled loop
    (a few torch calls per set cost more than the work), else one at a time."""
    parts = []
    for packed in sets:
        code = _step_code(packed)
        if code is None:  # not made as a sender makes them: told apart one at a time
            return [], next(j for j, each in enumerate(sets) if packed_problem(each) is not None)
        assert type(packed) is PackedIds
        parts.append((packed.first, code, np.ascontiguousarray(packed.steps.numpy())))
    ids, malformed = native.unpack_steps(parts, _unpack_by_torch)
    if malformed >= 0:
        return [], malformed
    return list(torch.from_numpy(ids).split_with_sizes([steps.size for _, _, steps in parts])), -1


_STEP_CODES = {dtype: code for code, dtype in enumerate(STEP_DTYPES)}


def _step_code(packed: object) -> int | None:
    """The code of ``packed``'s steps' dtype (its place in :data:`STEP_DTYPES`), where it is a
    :class:`PackedIds` whose first id and steps the compiled loop can take: a first id within
    int64, 1-D steps on the CPU; else None."""
    if type(packed) is not PackedIds:
        return None
    first, steps = getattr(packed, "first", None), getattr(packed, "steps", None)
    if type(first) is not int or not _INT64_MIN <= first <= _INT64_MAX or type(steps) is not Tensor:
        return None
    if steps.layout != torch.strided or not steps.is_cpu or steps.requires_grad:
        return None
    return _STEP_CODES.get(steps.dtype) if steps.dim() == 1 else None


def _unpack_by_torch(parts: Sequence[tuple[int, int, np.ndarray]]) -> native.Unpacked:
    """:func:`paramserver.native.unpack_steps`' result, a set at a time."""
    ids = np.empty(sum(steps.size for _, _, steps in parts), np.int64)
    at = 0
    for j, (first, _, steps) in enumerate(parts):
        packed = PackedIds(first, torch.from_numpy(steps))
        if packed_problem(packed) is not None:
            return ids, j
        ids[at : at + steps.size] = unpack_ids(packed).numpy()
        at += steps.size
    return ids, -1


@dataclass(frozen=True, eq=False)
class PackedTables:
    """The sorted unique ids of several tables, ``names``, as one message carries them to one
    server: per table its first id (``firsts``, int64), its count of ids times 4 plus the code
    of its steps' type (``sizes``, int32; the code is its place in :data:`STEP_DTYPES`, or
    :data:`IDS_CODE`: no step type holds them, and its int64 ids travel instead), and in
    ``data`` (uint8) its steps, as :class:`PackedIds` holds them (or its ids), each table's
    from the end of the one before aligned to 8. Three tensors however many tables, 12 bytes a
    table beside its steps: made in one call (:func:`pack_tables`), and a receiver unpacks and
    checks them in one (:func:`unpack_tables`)."""

    names: tuple[str, ...]
    firsts: Tensor
    sizes: Tensor
    data: Tensor


IDS_CODE = len(STEP_DTYPES)  # a table's ids travel as int64 ids, not steps
_CODE_WIDTHS = np.array([dtype.itemsize for dtype in STEP_DTYPES] + [8], np.int64)
_CODE_BITS = 2  # a table's size is its count of ids shifted past its code


def table_counts(sizes: np.ndarray) -> np.ndarray:
    """Each table's count of ids, from the ``sizes`` of a :class:`PackedTables` (int64)."""
    return sizes.astype(np.int64) >> _CODE_BITS


def _count_and_code(size: int) -> tuple[int, int]:
    return size >> _CODE_BITS, size & (1 << _CODE_BITS) - 1


def pack_tables(names: Sequence[str], parts: Sequence[Tensor]) -> PackedTables:
    """``parts`` (1-D int64 ids, each sorted unique: table ``names[j]``'s) as one message
    carries them (see :class:`PackedTables`): every table in one call of the compiled loop,
    else in a few numpy operations over them all."""
    firsts, sizes = np.empty(len(parts), np.int64), np.empty(len(parts), np.int32)
    data = np.empty(8 * (sum(part.numel() for part in parts) + len(parts)), np.uint8)
    used = native.pack_tables(parts, firsts, sizes, data, _pack_tables_by_numpy)
    return PackedTables(
        tuple(names),
        torch.from_numpy(firsts),
        torch.from_numpy(sizes),
        torch.from_numpy(data[:used]),
    )


def _pack_tables_by_numpy(
    parts: Sequence[np.ndarray], firsts: np.ndarray, sizes: np.ndarray, data: np.ndarray
) -> int:
    """:func:`paramserver.native.pack_tables`' result, by numpy."""
    at = 0
    for j, (part, (first, dtype, steps)) in enumerate(
        zip(parts, _pack_by_numpy(parts), strict=True)
    ):
        if part.size >= 2**29:
            raise ValueError("pack_tables: a part of 2^29 ids or more")
        code = IDS_CODE if dtype is None else _STEP_CODES[_TORCH_OF[dtype]]
        offset = -(-at // 8) * 8
        payload = np.ascontiguousarray(part if dtype is None else steps).view(np.uint8)
        data[offset : offset + payload.size] = payload
        firsts[j], sizes[j] = first, (part.size << _CODE_BITS) + code
        at = offset + payload.size
    return at


@dataclass(frozen=True)
class TablesProblem:
    """Why a peer's :class:`PackedTables` was refused: its ``table`` (None: the whole set,
    laid out wrong) and the ``reason``."""

    table: str | None
    reason: str


def unpack_tables(packed: object) -> dict[str, Tensor] | TablesProblem:
    """The int64 ids of each table of a peer's :class:`PackedTables`, views of one new
    tensor, by name; or what is wrong with it (each set's steps checked as
    :func:`packed_problem` checks a :class:`PackedIds`; ids that travel as ids are the
    caller's to check, as plain ids are). Never raises; at most 8 bytes of ids per byte of
    ``data`` are made (each id takes a byte or more of it)."""
    if type(packed) is not PackedTables:
        return TablesProblem(None, f"expected PackedTables, got {type(packed).__name__}")
    names = packed.names
    if type(names) is not tuple or not all(type(name) is str for name in names):
        return TablesProblem(None, "its names must be a tuple of strings")
    if len(set(names)) != len(names):
        return TablesProblem(None, "it names a table twice")
    firsts = _flat_array(packed.firsts, np.int64, len(names))
    sizes = _flat_array(packed.sizes, np.int32, len(names))
    data = _flat_array(packed.data, np.uint8, None)
    if firsts is None or sizes is None or data is None:
        return TablesProblem(
            None, "its firsts and sizes must be int64 and int32, one a table, its data uint8"
        )
    counts = table_counts(sizes)
    total = int(counts.sum())
    if (counts.size and counts.min() < 0) or total > data.size:
        return TablesProblem(None, "its counts are not counts of the ids its data holds")
    ids = np.empty(total, np.int64)
    problem, table = native.unpack_tables(firsts, sizes, data, ids, _unpack_tables_by_torch)
    if problem == 1:
        return TablesProblem(None, "its sizes do not lay its tables out in its data exactly")
    if problem == 2:
        return TablesProblem(names[table], str(packed_problem(_table_packed(packed, table))))
    parts = torch.from_numpy(ids).split_with_sizes(counts.tolist())  # (not split: its wrapper)
    return dict(zip(names, parts, strict=True))


def _flat_array(tensor: object, dtype: type, length: int | None) -> np.ndarray | None:
    """A peer's ``tensor`` as numpy reads it, where it is a plain 1-D contiguous CPU tensor of
    ``dtype`` (and ``length`` elements, where given); else None. (numpy reads a tensor's
    attributes for a fraction of torch's cost, and ``numpy()`` itself refuses one that needs a
    gradient, is not on the CPU or is not strided.)"""
    if type(tensor) is not Tensor:
        return None
    try:
        array = tensor.numpy()
    except (RuntimeError, TypeError):
        return None
    if (
        array.dtype != dtype
        or array.ndim != 1
        or not array.flags.c_contiguous
        or (length is not None and array.size != length)
    ):
        return None
    return array


def _offsets(sizes: np.ndarray) -> np.ndarray:
    """Where each table's steps start in a :class:`PackedTables`' data, and the end of the
    last (in bytes), from its sizes (not negative)."""
    offsets = np.zeros(len(sizes) + 1, np.int64)
    at = 0
    for j, size in enumerate(sizes.tolist()):
        count, code = _count_and_code(size)
        offsets[j] = -(-at // 8) * 8
        at = int(offsets[j]) + count * int(_CODE_WIDTHS[code])
    offsets[-1] = at
    return offsets


def _table_packed(packed: PackedTables, table: int) -> PackedIds:
    """Table ``table`` of well laid out ``packed`` (of steps) as :class:`PackedIds`."""
    sizes = packed.sizes.numpy()
    count, code = _count_and_code(int(sizes[table]))
    dtype, start = STEP_DTYPES[code], int(_offsets(sizes)[table])
    steps = packed.data[start : start + count * dtype.itemsize].view(dtype)
    return PackedIds(int(packed.firsts[table]), steps)


def _unpack_tables_by_torch(
    firsts: np.ndarray, sizes: np.ndarray, data: np.ndarray, out: np.ndarray
) -> tuple[int, int]:
    """:func:`paramserver.native.unpack_tables`' result, a table at a time."""
    if (sizes < 0).any() or firsts.size != sizes.size:
        return 1, -1
    offsets = _offsets(sizes)
    if int(offsets[-1]) != data.size or int(table_counts(sizes).sum()) != out.size:
        return 1, -1
    at = 0
    for j, (first, size) in enumerate(zip(firsts.tolist(), sizes.tolist(), strict=True)):
        (count, code), start = _count_and_code(size), int(offsets[j])
        raw = data[start : start + count * int(_CODE_WIDTHS[code])]
        if code == IDS_CODE:
            out[at : at + count] = raw.view(np.int64)
        else:
            packed = PackedIds(first, torch.from_numpy(raw.view(_NUMPY_STEPS[code])))
            if packed_problem(packed) is not None:
                return 2, j
            out[at : at + count] = unpack_ids(packed).numpy()
        at += count
    return 0, -1


_TORCH_OF = {np.dtype(str(dtype).removeprefix("torch.")): dtype for dtype in STEP_DTYPES}
_NUMPY_STEPS = list(_TORCH_OF)


def num_ids(ids: object) -> int:
    """How many ids a message's ids field stands for, whatever it holds: a tensor's elements,
    a :class:`PackedIds`'s steps; 0 for anything else (refused later)."""
    if type(ids) is PackedIds:
        ids = getattr(ids, "steps", None)
    return ids.numel() if isinstance(ids, Tensor) else 0


def packed_problem(packed: object) -> str | None:
    """None if ``packed`` is a well-formed :class:`PackedIds` (its ids sorted, unique and
    within int64), else a short reason. Never raises; its work grows with the steps sent."""
    if type(packed) is not PackedIds:
        return f"expected PackedIds, got {type(packed).__name__}"
    first, steps = getattr(packed, "first", None), getattr(packed, "steps", None)
    if type(first) is not int or not _INT64_MIN <= first <= _INT64_MAX:
        return "first id must be an int within int64"
    if (
        type(steps) is not Tensor
        or steps.layout != torch.strided
        or not steps.is_cpu
        or steps.requires_grad
        or steps.dim() != 1
    ):
        return "steps must be a 1-D dense CPU tensor without autograd"
    if steps.dtype not in STEP_DTYPES:
        return f"steps must be uint8, int16 or int32, got {steps.dtype}"
    if steps.numel() == 0:
        return None
    if int(steps.min()) < 0:
        return "negative step"
    if steps.numel() > 1 and int(steps[1:].min()) == 0:
        return "a step of 0 after the first: ids must be unique"
    # Under 2^31 steps of under 2^31 each sum below 2^62 in int64: no overflow on the way.
    if steps.numel() >= 2**31 or first + int(steps.sum(dtype=torch.int64)) > _INT64_MAX:
        return "ids past int64"
    return None


def min_id_nbytes(num_ids: int, num_rows: int) -> float:
    """The fewest bytes that can name ``num_ids`` distinct rows out of ``num_rows``: ``log2``
    of the number of such sets, ``C(num_rows, num_ids)``, in bits over 8. No encoding does
    better on every set (nor on average over sets drawn uniformly): the yardstick of
    ``benchmarks/bench_comm.py``."""
    if not 0 <= num_ids <= num_rows:
        raise ValueError(f"{num_ids} distinct ids out of {num_rows} rows")
    ln_sets = (
        math.lgamma(num_rows + 1) - math.lgamma(num_ids + 1) - math.lgamma(num_rows - num_ids + 1)
    )
    return ln_sets / math.log(2) / 8
