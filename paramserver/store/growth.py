"""How storage grows, in one place: a dynamic table's rows and state, the id map's arrays,
a trainer's row cache, and where storage that never grows is allocated.

Storage that grows with its rows is given room beyond them, untouched (so costing no memory
until used), and extended in place while the room lasts: a copy stalls its owner (a table of
gigabytes, seconds) and holds the storage twice meanwhile, so copies must be rare.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile

import numpy as np
import torch
from torch import Tensor

from paramserver import native
from paramserver.optim import Empty

RESERVE_GROWTH = 8  # grown storage reserves room (untouched) for this many times its rows
ROW_GROWTH = 1.15  # row storage grows by this factor, bounding its slack to 15%
HUGE_PAGE_BYTES = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_MADV_RANDOM: int | None = getattr(mmap, "MADV_RANDOM", None)


def _half_the_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):  # a system that does not say: no more room
        return 0


# The address space a growing tensor (a dynamic table's rows, each of their state slots) is
# given room in: half the machine's memory, which Linux's default overcommit heuristic grants
# one mapping; untouched, it costs no memory.
GROWTH_ROOM_BYTES = _half_the_memory()


def grown_rows(held: int, needed: int) -> int:
    """The row capacity to grow storage of ``held`` rows to, when ``needed`` rows must fit."""
    return max(needed, int(held * ROW_GROWTH) + 16)


def grown_array(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` (1-D) with ``size`` entries, its own first and the others uninitialised: a
    longer view of the allocation it starts, where that has room, else copied into a new one
    with room (untouched, so costing no memory until used) for :data:`RESERVE_GROWTH` times
    ``size``: so copies are rare as a map grows."""
    base = array.base
    if (
        isinstance(base, np.ndarray)
        and base.dtype == array.dtype
        and base.ndim == 1
        and base.size >= size
        and base.ctypes.data == array.ctypes.data
    ):
        return base[:size]
    grown = np.empty(size * RESERVE_GROWTH, dtype=array.dtype)[:size]
    grown[: array.size] = array
    return grown


def with_rows(tensor: Tensor, rows: int) -> Tensor:
    """``tensor`` copied into storage of ``rows`` rows; the new rows are uninitialized (their
    owners set every row before it is read)."""
    grown = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    grown[: tensor.shape[0]] = tensor
    return grown


def row_storage(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Uninitialised storage for a table's rows or their state, allocated whole (a fixed
    table's), owned by the caller.

    Requests read and write rows at random across whole tables (gigabytes): with 4 KiB pages
    nearly every row costs a TLB miss as well as a cache miss. So storage that spans a huge page
    is mapped on its own and marked for transparent huge pages (``madvise(MADV_HUGEPAGE)``,
    before anything touches it), which Linux honours in its ``madvise`` and ``always`` modes
    (``/sys/kernel/mm/transparent_hugepage/enabled``) where it has free huge pages, and falls
    back to small pages otherwise; elsewhere (other systems, small tensors) ``torch.empty``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    memory = _mapped(nbytes)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small ones
        memory.madvise(_MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # keeps ``memory`` mapped


def file_backed(directory: str | os.PathLike[str]) -> Empty:
    """An allocator like :func:`row_storage` whose storage is a file in ``directory``, mapped
    shared: its pages are the file's, which the system writes back and drops under memory
    pressure (counted as ``RssFile``, not ``RssAnon``), so rows larger than memory can be held,
    the hot ones in memory. The file is unlinked at once: it lives as long as the mapping."""

    def empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        fd, path = tempfile.mkstemp(prefix="rows-", dir=directory)
        try:
            os.unlink(path)
            os.ftruncate(fd, nbytes)
            memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)  # the mapping holds the file
        if _MADV_RANDOM is not None:  # rows are read at random: read no pages around them
            memory.madvise(_MADV_RANDOM)
        return torch.frombuffer(memory, dtype=dtype).view(shape)  # keeps ``memory`` mapped

    return empty


def _mapped(nbytes: int, *, reserved: bool = True) -> mmap.mmap:
    """``nbytes`` of anonymous memory mapped on their own: the system gives a page its memory
    (zeroed) when something first touches it, not before. Not ``reserved``: the pages are not
    charged to the system's commit until touched (``MAP_NORESERVE``), which room far beyond
    what is used needs: else a fork (a ``subprocess`` with ``preexec_fn``, a DataLoader's
    workers) is charged all of it, and refused."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not reserved:
        flags |= native.MAP_NORESERVE
    return mmap.mmap(-1, nbytes, flags=flags)


def regrown(tensor: Tensor, rows: int, most: int | None = None) -> Tensor:
    """``tensor`` (storage of its own, as this makes) with ``rows`` rows, its own first and
    the others uninitialised (their owner sets each before it is read), for storage that grows
    with its rows (a dynamic table's): extended in place where its storage has room, else
    copied into storage with room to grow in place (:func:`_room`; at most ``most`` rows
    where the rows are bounded), so copies are rare as a table grows: a copy stalls the
    server (a table of gigabytes, seconds) and holds the storage twice meanwhile.

    Not on huge pages: rows are created a few hundred at a time, and a huge page faulted in
    as they reach it (zeroed whole, memory compacted for it) cost more than its fewer TLB
    misses saved (the core model's dynamic tables: filling 5.3-5.5 ms a step with small pages
    against 7.3-7.9 with huge ones, and no faster once filled)."""
    shape = (rows, *tensor.shape[1:])
    storage = tensor.untyped_storage()
    fits = math.prod(shape) * tensor.element_size() <= storage.nbytes()
    if fits and tensor.storage_offset() == 0 and tensor.is_contiguous():
        whole = torch.empty(0, dtype=tensor.dtype).set_(storage)
        return whole[: math.prod(shape)].view(shape)
    grown = _room(shape, tensor.dtype, most)[:rows]
    grown[: tensor.shape[0]] = tensor
    return grown


def _room(shape: tuple[int, ...], dtype: torch.dtype, most: int | None) -> Tensor:
    """Uninitialised storage for ``shape[0]`` rows and room for more: as many as fit in
    :data:`GROWTH_ROOM_BYTES` (at least :data:`RESERVE_GROWTH` times the rows), but no more
    than ``most``, mapped on their own and unreserved (:func:`_mapped`), so rows not yet
    reached cost no memory. Where the system refuses that much address space (strict
    overcommit, a limit on it) or cannot leave it unreserved (no ``MAP_NORESERVE`` without
    the compiled loops): :data:`RESERVE_GROWTH` times the rows, else the rows alone."""
    rows, row_bytes = shape[0], math.prod(shape[1:]) * dtype.itemsize
    reserve = rows * RESERVE_GROWTH
    wide = max(GROWTH_ROOM_BYTES // row_bytes, reserve) if native.MAP_NORESERVE else reserve
    for room, reserved in ((wide, False), (reserve, True)):
        room = room if most is None else min(room, most)
        if room > rows:
            with contextlib.suppress(OSError):
                memory = _mapped(room * row_bytes, reserved=reserved)
                return torch.frombuffer(memory, dtype=dtype).view(room, *shape[1:])
    return torch.empty(shape, dtype=dtype)
