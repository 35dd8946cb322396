"""paramserver's hot loops, compiled where the install could build them (``_native.c``, built by
``setup.py``; a C compiler is optional), and the one place that decides, call by call, whether
the compiled loop or numpy (or torch) does the work.

numpy does the same work in several passes over memory, each a separate call with its own
cost: a server's step touches a few thousand rows scattered over gigabytes, so one pass per row
is what sets its speed. The operations, each a function here with the same result either way
(the tests run both and compare):

- :func:`probe` and :func:`place`: an id map (:mod:`paramserver.store.idmap`) searches a batch
  of ids and places new ones one id at a time, reading a slot and its row's record once each
  (numpy, :mod:`paramserver.store.probing`: a round of array operations per window of slots);
  :func:`rehash` rebuilds its slot array larger in one pass over the old one (numpy: the live
  rows listed, their ids gathered and sorted by home slot);
- :func:`step_rows`: Adagrad or SGD on a table's rows (:mod:`paramserver.optim`) updates each row
  in place, read and written once (torch.optim: a gather, the rule's passes, a scatter), with
  torch's float operations in torch's order: bitwise the same;
- :func:`own_rows`: a prefetching trainer's own update of the rows it pulled
  (:mod:`paramserver.trainer.ownupdates`), every table in one call, by the servers' math
  (torch: a search, a gather, the rule's passes and a scatter per table);
- :func:`ascending_within` and :func:`all_finite`: a server checks a request's row ids (each
  set rising, within its table's bounds) and its gradients (no NaN or Inf) in one call each,
  whatever the number of tables (numpy: a few array operations over the sets joined; torch: a
  sum over the gradients joined, a copy);
- :func:`init_rows`: a dynamic table's new rows (:mod:`paramserver.store.rowinit`) get their
  values and optimizer state in one write per row (numpy and torch: a pass per array);
- :func:`places_each`: a prefetching trainer finds which of each table's prefetched ids its
  pending step touched, and where (:mod:`paramserver.trainer.ownupdates`), every table in one
  call (numpy: a ``searchsorted`` and its checks per table);
- :func:`unpack_steps`: a server unpacks a request's packed row ids, every set checked and
  unpacked in one call (torch: a few checks and a cumulative sum per set, each with its own
  cost); :func:`pack_tables` and :func:`unpack_tables` pack and unpack several tables' ids as
  one message carries them, in one buffer (numpy and torch: a few calls per table);
- :func:`unique_lookups`: a trainer's record pass (:mod:`paramserver.trainer.lookups`) finds
  every table's unique ids and each lookup's positions among them in one call (torch: a
  ``torch.unique`` per table and a split per lookup, each with its own cost);
- :func:`gather_rows` and :func:`scatter_rows`: a trainer's forward makes its step's lookups of
  every table in one call, and its backward adds their gradients in one (torch: an
  ``index_select`` and an ``index_add_`` per lookup);
- :func:`pool_bags` and :func:`scatter_bags`: the same for pooled lookups (``EmbeddingBag``),
  the backward adding each row's terms in the order torch's does (:func:`sort_order`; torch: a
  sort of the ids and a dispatched axpy per id, lookup by lookup).

Built beside torch (``setup.py``; the Makefile's install), the loops take torch tensors as they
are: ``_tensors.cpp`` reads a tensor's memory in C++, where a ``numpy()`` of it costs thousands of
instructions, which a step would pay for each of its tables' tensors (:func:`takes_tensors`); and
a frame's tensors (:mod:`paramserver.wire.frames`) are reduced, copied and made there too
(:mod:`paramserver.native_frames` chooses for those, as this module does for the rest). The
trainer's loops run only where they take tensors; built without torch, the loops take numpy
arrays, as a server's id map and checks hand them.

A caller calls the operation and never asks whether the loops are built. Where both paths give
one result, the caller hands in its own path as ``fallback``, which the operation calls with
the same arguments where there is no loop or the loop does not take the arrays given. The
fallbacks stay beside their callers, not here: each works on its caller's structures (the id
map's slot array, a table's arena, a request's bundles of tensors) and reads best beside the
algorithm it belongs to; this module holds only the choice and the compiled calls' arguments.
Where a caller's algorithm itself differs with the loops, the caller asks a capability,
:func:`takes_rows` (Adagrad stepped in place rather than gathered; a step's lookups joined in
one autograd node) or :func:`placing_is_cheap` (an id map's inserts), and then calls a loop that
has no fallback.

The module also names :data:`MAP_NORESERVE` for :mod:`mmap`, which Python's does not: a dynamic
table's storage maps room to grow in with it (:mod:`paramserver.store.growth`).

``PARAMSERVER_NATIVE=0`` in the environment turns the loops off (to compare, or to rule them
out). A test takes the numpy paths by setting :data:`loops` to None (tests/conftest.py's
``loop_mode`` runs a test both ways), or calls a caller's fallback itself. Every operation reads
:data:`loops` when called, so that switch holds from the next call on.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType

import numpy as np
import torch
from torch import Tensor


def _load() -> ModuleType | None:
    if os.environ.get("PARAMSERVER_NATIVE", "1") == "0":
        return None
    try:
        module = importlib.import_module("paramserver._native")
    except ImportError:
        return None
    built_with = getattr(module, "TORCH_VERSION", torch.__version__)
    if built_with != torch.__version__:  # linked to another torch's libraries: not safe to call
        warnings.warn(
            f"paramserver's compiled loops were built with torch {built_with}, not this "
            f"{torch.__version__}: they are off (reinstall paramserver to build them again)",
            stacklevel=2,
        )
        return None
    return module


loops: ModuleType | None = _load()
"""The compiled module, or None: read only by this module's functions."""

MAP_NORESERVE: int = getattr(loops, "MAP_NORESERVE", 0)
"""mmap's flag for address space charged to the system's commit only once touched (0: none)."""

Probed = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # rows, where searches ended, payloads
Recipe = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # ids, salts, scales, multipliers
# An id map's search and placement by numpy: (slots, records or ids, ids, spaces, hashing).
Search = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int]], Probed]
Placement = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, tuple[int, int]], int]
# An id map's rebuild by numpy: (old slots, records or ids, new slots, hashing).
Rehash = Callable[[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]], None]


def _contiguous(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else np.ascontiguousarray(array)


# ---- capabilities: where a caller's algorithm differs with the loops ----


def takes_tensors() -> bool:
    """Whether the loops are built and take torch tensors as they are (built with torch's
    headers: setup.py). The trainer's loops and a server's row updates are called with the
    step's tensors, a ``numpy()`` of each costing as much as their Python: they run where this
    holds, and the same work is left to torch where it does not."""
    return loops is not None and bool(loops.TAKES_TENSORS)


def takes_rows(*tensors: Tensor) -> bool:
    """Whether the loops are built, take tensors and take these as tables of rows: float32,
    2-D and contiguous (what they index as plain arrays)."""
    return takes_tensors() and bool(loops.are_rows(tensors, False))  # type: ignore[union-attr]


def placing_is_cheap() -> bool:
    """Whether :func:`place` walks from each id's home slot in a loop: then placing an id costs
    about what claiming the slot that ended its search would, and an id map skips that claim
    (numpy places in rounds of array operations, which the claim mostly spares)."""
    return loops is not None


# ---- one result by either path: the caller's own path handed in ----


def probe(
    slots: np.ndarray,
    records: np.ndarray,
    ids: np.ndarray,
    spaces: np.ndarray | None,
    hashing: tuple[int, int],
    fallback: Search,
) -> Probed:
    """Search an id map's ``slots`` (int32 rows; -1 empty, -2 deleted; not all full) for
    ``ids``, each in its space of ``spaces`` (None: a map without spaces): each id's row (-1:
    absent), the slot where its search ended and, for a map keyed by space, its row's payload.
    ``records``: each row's id (int64), or its record (fields id, payload and space: a map keyed
    by space). ``hashing``: the home slot's hash, (multiplier, space stride)."""
    if loops is None:
        return fallback(slots, records, ids, spaces, hashing)
    rows = np.empty(ids.size, dtype=np.int64)
    ends = np.empty(ids.size, dtype=np.int64)
    keyed = records.dtype.fields is not None
    payloads = np.empty(ids.size, dtype=np.int32) if keyed else None
    raw, layout = _record_layout(records)
    loops.probe(
        slots, raw, *layout, np.ascontiguousarray(ids, dtype=np.int64), _contiguous(spaces),
        *hashing, rows, ends, payloads,
    )  # fmt: skip
    return rows, ends, payloads


def _record_layout(records: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int, int]]:
    """An id map's records as the loops read them (bytes), and their layout: a record's
    size, its space's offset and size (-1 and 1: not keyed by space) and its payload's
    offset (-1: none)."""
    fields = records.dtype.fields
    if fields is None:  # a record is its id
        return records, (8, -1, 1, -1)
    layout = (records.itemsize, fields["space"][1], fields["space"][0].itemsize,
              fields["payload"][1])  # fmt: skip
    return records.view(np.uint8), layout


def place(
    slots: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    spaces: np.ndarray | None,
    hashing: tuple[int, int],
    fallback: Placement,
) -> int:
    """Put the ``rows`` of absent ``ids`` in the first free slot of their probe sequences, in
    ``slots`` (as :func:`probe`'s); returns how many of the slots taken were deleted ones. The
    loop places the ids one by one, in order; numpy's rounds may leave another layout of slots,
    as valid."""
    if loops is None:
        return fallback(slots, ids, rows, spaces, hashing)
    return int(
        loops.place(
            slots, np.ascontiguousarray(ids, dtype=np.int64), _contiguous(spaces),
            np.ascontiguousarray(rows, dtype=np.int64), *hashing,
        )
    )  # fmt: skip


def rehash(
    old_slots: np.ndarray,
    records: np.ndarray,
    slots: np.ndarray,
    hashing: tuple[int, int],
    fallback: Rehash,
) -> None:
    """Rebuild an id map: put the row of every live slot of ``old_slots`` (its id, and its
    space in a map keyed by space, read from its record of ``records``, as :func:`probe` takes
    them) in ``slots`` (empty, a power of two long, with room for all of them), each at the
    first free slot of its probe sequence. The loop takes them in ``old_slots``' order in one
    pass; numpy's way may leave another layout of slots, as valid."""
    if loops is None:
        fallback(old_slots, records, slots, hashing)
        return
    raw, (stride, space_offset, space_size, _) = _record_layout(records)
    loops.rehash(old_slots, raw, stride, space_offset, space_size, slots, *hashing)


def ascending_within(
    arrays: Sequence[np.ndarray] | Sequence[Tensor],
    bounds: list[tuple[int, int]],
    fallback: Callable[[list[np.ndarray], list[tuple[int, int]]], bool],
) -> bool:
    """Whether each of ``arrays`` (int64 ids, numpy's or tensors) rises strictly and lies
    within its ``bounds`` (low, high: both included)."""
    if not takes_tensors():  # numpy's arrays only, the loops' or the fallback's
        numpys = [a if isinstance(a, np.ndarray) else a.numpy() for a in arrays]
        if loops is None:
            return fallback(numpys, bounds)
        return bool(loops.ascending_within(numpys, bounds))
    assert loops is not None
    return bool(loops.ascending_within(arrays, bounds))


def all_finite(tensors: list[Tensor], fallback: Callable[[list[Tensor]], bool]) -> bool:
    """Whether ``tensors`` (plain CPU tensors) hold no NaN or Inf: the contiguous float32 ones
    in one pass of the loop, the others (all of them, without it) by ``fallback``."""
    if loops is None:
        return fallback(tensors)
    plain = [t.dtype == torch.float32 and t.is_contiguous() for t in tensors]
    fitting = [t for t, fits in zip(tensors, plain, strict=True) if fits]
    try:
        finite = loops.all_finite(fitting if takes_tensors() else [t.numpy() for t in fitting])
    except (RuntimeError, TypeError):  # one the loop cannot read (a negative bit): all to fallback
        return fallback(tensors)
    return finite and fallback([t for t, fits in zip(tensors, plain, strict=True) if not fits])


def init_rows(
    weight: Tensor,
    state: Sequence[Tensor],
    initial: float,
    rows: np.ndarray,
    recipe: Recipe,
    fallback: Callable[[Tensor, Sequence[Tensor], float, np.ndarray, Recipe], None],
) -> None:
    """Set new ``rows`` of a table's ``weight`` and its ``state`` slots: each row's values
    uniform in ``[-scale, scale)`` by the ``recipe`` (each row's id, salt and scale, and each
    column's multiplier, as :func:`paramserver.store.rowinit.init_rows` describes), its state
    ``initial``. The loop takes float32 rows."""
    if not takes_rows(weight, *state):
        fallback(weight, state, initial, rows, recipe)
        return
    assert loops is not None
    ids, salts, scales, multipliers = recipe
    loops.init_rows(
        weight.numpy(), weight.shape[1], np.ascontiguousarray(rows), np.ascontiguousarray(ids),
        salts, scales.astype(np.float32), multipliers, tuple(slot.numpy() for slot in state),
        initial,
    )  # fmt: skip


def unique_lookups(
    groups: list[list[Tensor]],
    fallback: Callable[[list[list[Tensor]]], list[tuple[Tensor, list[tuple[Tensor, Tensor]]]]],
) -> list[tuple[Tensor, list[tuple[Tensor, Tensor]]]]:
    """For each table's lookups' ids (``groups``: 1-D integer tensors), its sorted unique ids
    and, per lookup, its ids as int64 and each one's index among them: what
    ``torch.unique(torch.cat(lookups), return_inverse=True)`` gives, all tables in one call of
    the loops (where they take these tensors: int32 or int64 on the CPU), else ``fallback``."""
    if not takes_tensors():
        return fallback(groups)
    found: list[tuple[Tensor, list[tuple[Tensor, Tensor]]]] | None
    found = loops.unique_lookups(groups)  # type: ignore[union-attr]
    return fallback(groups) if found is None else found


Packed = list[tuple[int, np.dtype | None, np.ndarray]]


def pack_steps(
    parts: Sequence[np.ndarray], fallback: Callable[[Sequence[np.ndarray]], Packed]
) -> Packed:
    """Each of ``parts`` (1-D int64, sorted unique) as the wire carries row ids
    (:mod:`paramserver.wire.idcodec`): ``(first id, dtype, steps)`` with the steps between its
    ids (``steps[0]`` 0) in the narrowest of uint8, int16 and int32 that holds them; dtype None
    (and the ids as steps) where none does. Every part in one call of the loop, the steps in
    one buffer."""
    if loops is None:
        return fallback(parts)
    arrays = [np.ascontiguousarray(part, np.int64) for part in parts]
    out = np.empty(4 * sum(a.size for a in arrays) + 8 * len(arrays), np.uint8)
    packed: Packed = []
    for array, (first, code, offset) in zip(arrays, loops.pack_steps(arrays, out), strict=True):
        if code == _STEPS_NONE:
            packed.append((first, None, array))
        else:
            dtype = _STEP_TYPES[code]
            packed.append((first, dtype, np.ndarray(array.size, dtype, out, offset)))
    return packed


_STEP_TYPES = (np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.int32))  # pack_steps' codes
_STEPS_NONE = 3


Unpacked = tuple[np.ndarray, int]


def unpack_steps(
    parts: Sequence[tuple[int, int, np.ndarray]],
    fallback: Callable[[Sequence[tuple[int, int, np.ndarray]]], Unpacked],
) -> Unpacked:
    """The inverse of :func:`pack_steps`, checked: each part, ``(first id, code of its steps'
    type, steps)``, as its ids (``first`` plus the running sum of its steps), every part's end
    to end (int64); and the place of the first malformed part (a negative step, a step of 0
    after the first, an id past int64), -1 where none is (the ids from it on mean nothing).
    Every part in one call of the loop."""
    if loops is None:
        return fallback(parts)
    ids = np.empty(sum(steps.size for _, _, steps in parts), np.int64)
    return ids, int(loops.unpack_steps(parts, ids))


def pack_tables(
    parts: Sequence[Tensor],
    firsts: np.ndarray,
    sizes: np.ndarray,
    data: np.ndarray,
    fallback: Callable[[Sequence[np.ndarray], np.ndarray, np.ndarray, np.ndarray], int],
) -> int:
    """Several tables' ids (``parts``, each 1-D int64 sorted unique, under 2^29 of them) as
    one message carries them (:class:`paramserver.wire.idcodec.PackedTables`): each one's first
    id in ``firsts`` (int64), its count times 4 plus the code of its steps' type in ``sizes``
    (int32; code 3: no step type holds them, and its ids travel), its steps or ids in ``data``
    (uint8, at least ``8 * (ids + parts)``), each from the end of the one before aligned to 8;
    returns the bytes of ``data`` used. Every part in one call of the loop (where it takes
    tensors; the fallback takes numpy arrays)."""
    if not takes_tensors():
        return fallback([int64s(part).numpy() for part in parts], firsts, sizes, data)
    assert loops is not None
    return int(loops.pack_tables([int64s(part) for part in parts], firsts, sizes, data))


def unpack_tables(
    firsts: np.ndarray,
    sizes: np.ndarray,
    data: np.ndarray,
    out: np.ndarray,
    fallback: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[int, int]],
) -> tuple[int, int]:
    """The inverse of :func:`pack_tables` on a peer's ``firsts``, ``sizes`` and ``data``,
    checked: every table's ids end to end in ``out`` (int64, the counts summed); returns
    ``(0, -1)``, or ``(1, -1)`` where the sizes do not lay their tables out in ``data``
    exactly, or ``(2, table)`` where that table's steps are malformed (a negative step, a step
    of 0 after the first, an id past int64). The ids of a table of code 3 are copied
    unchecked. Every table in one call of the loop."""
    if loops is None:
        return fallback(firsts, sizes, data, out)
    problem, table = loops.unpack_tables(firsts, sizes, data, out)
    return int(problem), int(table)


Places = Callable[
    [np.ndarray, tuple[int, ...], np.ndarray, tuple[int, ...]], tuple[np.ndarray, np.ndarray]
]


def places_each(
    values: np.ndarray,
    value_sizes: tuple[int, ...],
    others: np.ndarray,
    other_sizes: tuple[int, ...],
    fallback: Places,
) -> tuple[np.ndarray, np.ndarray]:
    """For each segment of ``values`` (1-D int64, segments of ``value_sizes``) and the same
    segment of ``others`` (each sorted unique): each value's place among its others
    (``np.searchsorted``, capped at the last; 0 where there are none) and whether it is there
    (bool), every segment in one call of the loop."""
    if loops is None:
        return fallback(values, value_sizes, others, other_sizes)
    at, found = np.empty(values.size, np.int64), np.empty(values.size, np.bool_)
    loops.places_each(
        np.ascontiguousarray(values, np.int64), value_sizes,
        np.ascontiguousarray(others, np.int64), other_sizes, at, found,
    )  # fmt: skip
    return at, found


# ---- loops without a fallback: called once a capability says they apply ----


RULE_KINDS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2}
"""The rules :func:`step_rows` and :func:`own_rows` step, by name, as the loops number them."""


def step_rows(
    kind: str,
    storage: tuple[Tensor, Tensor | None],
    parts: Sequence[tuple[Tensor, Tensor]],
    lr: float,
    *,
    eps: float,
    weight_decay: float,
    fused: bool,
) -> None:
    """torch.optim's update by rule ``kind`` (``"sgd"``: SGD without momentum; ``"adagrad"``:
    fused Adagrad, float32, no lr decay) of ``weight[rows]`` (and ``sums[rows]``, Adagrad's;
    None for SGD) in place with ``grads``, for each (rows, grads) of ``parts`` (``storage``:
    weight and sums, which :func:`takes_rows`); ``fused``: multiply-adds rounded once (else
    twice). One call a part, not one for all, which would join the parts' gradients first: a
    copy as long as the loop's work."""
    assert loops is not None, "called where takes_rows() says the loops apply"
    weight, sums = storage
    for rows, grads in parts:
        loops.step_rows(RULE_KINDS[kind], weight, sums, weight.shape[1], int64s(rows), grads,
                        lr, eps, weight_decay, fused)  # fmt: skip


def int64s(ids: Tensor) -> Tensor:
    """``ids`` as the loops read ids: contiguous int64 (themselves where they are: asked
    first, for a fraction of what ``to`` and ``contiguous`` cost where nothing changes)."""
    if ids.dtype is torch.int64 and ids.is_contiguous():
        return ids
    return ids.to(torch.int64).contiguous()


def gather_rows(tables: list[Tensor], lookups: list[tuple[int, Tensor, Tensor]], dim: int) -> None:
    """Copy each lookup's rows, ``tables[table][positions]``, into its output, for each
    (table, positions, output) of ``lookups`` (the tables and outputs float32 rows of
    ``dim``, which :func:`takes_rows`)."""
    assert loops is not None, "called where takes_rows() says the loops apply"
    loops.gather_rows(tables, lookups, dim)


def scatter_rows(tables: list[Tensor], lookups: list[tuple[int, Tensor, Tensor]], dim: int) -> None:
    """Add each lookup's gradient rows into ``tables[table]`` at its positions, lookup by
    lookup and row by row (``index_add_``'s order), for each (table, positions, gradients)
    of ``lookups``."""
    assert loops is not None, "called where takes_rows() says the loops apply"
    loops.scatter_rows(tables, lookups, dim)


OwnTable = tuple[Tensor, int, Tensor, Tensor, Tensor, Tensor | None, float]
"""One table's part of :func:`own_rows`: values, dim, ids, grad_ids, grads, means, lr
(``_native.c``'s own_rows says what each is)."""


def own_rows(
    kind: str,
    tables: Sequence[OwnTable],
    at: np.ndarray | None,
    state: Tensor | None,
    spans: np.ndarray | None,
    *,
    eps: float,
    weight_decay: float,
    fused: bool,
) -> int:
    """A trainer's own update by rule ``kind`` (of :data:`RULE_KINDS`) of the pulled rows of
    each of ``tables`` that have state and a gradient, in place, with their state; returns
    how many rows it updated. ``at``: every table's places of those rows end to end (int64),
    table ``j``'s from ``spans[j][0]`` to ``spans[j][1]`` (both None: every pulled row, in
    order, for SGD); ``state``: theirs, aligned with ``at`` (None for SGD). ``fused``:
    multiply-adds rounded once (else twice), as the servers' update on this machine (see
    :mod:`paramserver.optim`)."""
    assert loops is not None, "called where takes_rows() says the loops apply"
    return int(loops.own_rows(RULE_KINDS[kind], tables, at, state, spans, eps, weight_decay, fused))


def pools_rows(rows: Tensor) -> bool:
    """Whether the loops are built and pool bags of ``rows`` (:func:`pool_bags`): float32 or
    float64, 2-D and contiguous."""
    return takes_tensors() and bool(loops.are_rows((rows,), True))  # type: ignore[union-attr]


# One pooled lookup for pool_bags and scatter_bags: (table, positions, starts, weights or None,
# padding position or -1, mean, in_order (scatter_bags' order), the bags' rows: out, or their
# gradients).
BagArrays = tuple[int, Tensor, np.ndarray, Tensor | None, int, bool, bool, Tensor | None]


def zeroed_parts(sizes: Sequence[int], dim: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """Parts of ``sizes`` rows of ``dim`` zeros, views of one buffer end to end, for the
    gradients :func:`scatter_rows` and :func:`scatter_bags` add into (a push then sends them
    without joining them again)."""
    return torch.zeros(sum(sizes), dim, dtype=dtype).split_with_sizes(list(sizes))


def pool_bags(tables: list[Tensor], lookups: list[BagArrays], dim: int) -> None:
    """Sum each lookup's bags of rows of its table into its ``out`` (a mean: divided by the
    ids not padding), each bag in its ids' order from zero as torch's ``embedding_bag`` does;
    the tables and outputs rows of ``dim`` of one float type, which :func:`pools_rows`. Raises
    ValueError (nothing written) for bags that do not cover their ids in order from 0."""
    assert loops is not None, "called where pools_rows() says the loops apply"
    loops.pool_bags(tables, lookups, dim, tables[0].dtype == torch.float64)


def scatter_bags(tables: list[Tensor], lookups: list[BagArrays], dim: int) -> None:
    """:func:`pool_bags`' backward: each lookup's bag gradients (None: none), times the id's
    weight (a mean: 1 / the bag's size), added into ``tables[table]``'s row of each id that is
    not padding. A lookup ``in_order``: id by id as given, each product rounded first (torch's
    sparse gradient made dense); else by a multiply-add as torch's axpy makes it, id by id in
    :func:`sort_order` of the lookup's positions (the order of
    ``torch.sort(positions).indices``, which torch's dense backward visits them in, where
    :mod:`paramserver.trainer.bags`' check finds them equal)."""
    assert loops is not None, "called where pools_rows() says the loops apply"
    loops.scatter_bags(tables, lookups, dim, tables[0].dtype == torch.float64)


def sort_order(keys: np.ndarray) -> np.ndarray:
    """The order :func:`scatter_bags` visits a lookup's ids ``keys`` (int64, 1-D) in, as a
    permutation of their positions: that of C++'s ``std::sort`` of (key, position) pairs compared
    by key (torch's CPU sort below its radix sort's threshold, ``TORCH_RADIX_SORT_FROM`` ids),
    and positions ascending within a key (a stable sort, as that radix sort) from there on;
    what ``torch.sort(keys).indices`` is, where this torch build sorts so."""
    assert loops is not None, "called where pools_rows() says the loops apply"
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if keys.size >= loops.TORCH_RADIX_SORT_FROM:
        return np.argsort(keys, kind="stable")
    order = np.empty_like(keys)
    loops.sort_order(keys, order)
    return order
