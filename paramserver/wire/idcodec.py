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
    return list(torch.from_numpy(ids).split([steps.size for _, _, steps in parts])), -1


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
    if steps.layout != torch.strided or steps.device.type != "cpu" or steps.requires_grad:
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
        or steps.device.type != "cpu"
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
