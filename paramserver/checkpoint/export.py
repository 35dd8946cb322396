"""``paramserver export``: a checkpoint's model as one plain state_dict file, streamed.

The file is what ``torch.save(state_dict, path)`` writes: ``torch.load(path, weights_only=True)``
returns the state_dict (``mmap=True`` reads a model larger than memory lazily). Keys are those
of ``model.state_dict()`` for the dense parameters and fixed tables (rows ``0..N-1``); a
:class:`~paramserver.embedding.DynamicEmbedding` comes as ``NAME.ids`` (sorted) and
``NAME.weight``. Buffers are not served, so not saved: the model's own stay. A table whose
weight several layers share is saved once, every name of it referring to the same tensor
(as ``torch.save`` writes a model with tied weights).

A model exported this way may not fit in memory, so no table is ever held whole:

1. Every server's part is verified (sha256, as the manifest lists it) and kept open; where each
   tensor's bytes lie in it is read without the bytes (``torch.load`` onto the meta device).
2. The output's skeleton (each tensor's name, shape and dtype, with the space for its bytes) is
   saved with :func:`torch.serialization.skip_data` from fake tensors, and where each tensor's
   bytes go is read back the same way (the method of PyTorch's GPUDirect Storage tutorial;
   ``skip_data`` is a prototype there, so tests/test_export.py round-trips it on our torch).
3. Each table is written in id order by merging the servers' rows, a window of rows from each
   server at a time (fixed tables' rows are sorted by id in every part). A dynamic table's
   rows are first sorted by id one server's shard at a time, into a temporary file beside the
   output. So the export holds at most one table shard at a time (a dynamic table's, while it
   is sorted), and otherwise windows of 8 MiB of rows (a few copies of them).

The output is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from paramserver.checkpoint.store import DENSE_PART, Checkpoint, is_model_part
from paramserver.errors import CheckpointError

WINDOW_BYTES = 8 << 20  # the rows read from all servers at a time
_IO_MAX = 1 << 30  # bytes per pread or pwrite (Linux moves at most about 2 GiB a call)


@dataclass(frozen=True)
class Stored:
    """Where a contiguous tensor's bytes lie in a file written by ``torch.save``."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one element for a 1-d tensor)."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return (self.shape[0] if self.shape else 1) * self.row_bytes


def stored_tensors(f: IO[bytes], path: Path) -> dict[str, Stored]:
    """Where each tensor of the dict of tensors saved in ``f`` lies, read without its bytes."""
    f.seek(0)
    try:
        tensors = torch.load(f, map_location="meta", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read its tensors' layout: {e}") from e
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{path}: not a dict of tensors")
    found = {}
    for key, tensor in tensors.items():
        offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
        if not isinstance(offset, int) or not tensor.is_contiguous():
            raise CheckpointError(f"{path}: {key}: cannot locate its bytes (not contiguous)")
        start = offset + tensor.storage_offset() * tensor.element_size()
        found[key] = Stored(start, tensor.dtype, tuple(tensor.shape))
    return found


def read_bytes(fd: int, offset: int, size: int) -> np.ndarray:
    """``size`` bytes of ``fd`` at ``offset``, as uint8 (the file position is not used)."""
    out = np.empty(size, dtype=np.uint8)
    done = 0
    while done < size:
        got = os.preadv(fd, [out[done : done + _IO_MAX].data], offset + done)
        if got == 0:
            raise CheckpointError(f"file ends {size - done} bytes early (at {offset + done})")
        done += got
    return out


def write_bytes(fd: int, data: np.ndarray, offset: int) -> None:
    """All of the C-contiguous ``data`` into ``fd`` at ``offset``."""
    view = data.reshape(-1).view(np.uint8)
    done = 0
    while done < view.size:
        done += os.pwrite(fd, view[done : done + _IO_MAX].data, offset + done)


@dataclass(frozen=True)
class SortedRows:
    """One server's rows of a table, sorted by id: ids and row bytes in a file, read in pieces."""

    fd: int
    ids: Stored
    values: Stored

    @property
    def count(self) -> int:
        return self.ids.shape[0]

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``start .. start + count - 1``: their int64 ids and their bytes ``[n, row]``."""
        count = min(count, self.count - start)
        ids = read_bytes(self.fd, self.ids.offset + start * 8, count * 8).view(np.int64)
        row = self.values.row_bytes
        values = read_bytes(self.fd, self.values.offset + start * row, count * row)
        return ids, values.reshape(count, row)


Write = Callable[[int, np.ndarray, np.ndarray], None]  # (first row, ids, row bytes)


def merge_by_id(sources: list[SortedRows], write: Write, window_rows: int) -> int:
    """Every row of ``sources`` in id order, passed to ``write`` a window at a time; the number
    of rows. Each round reads up to ``window_rows`` rows from each source and writes those with
    ids up to the smallest last id read from a source that has more: none that follow can be
    smaller. Raises :class:`CheckpointError` if the ids are not unique and sorted per source."""
    cursors = [0] * len(sources)
    position, last = 0, None
    while live := [i for i, source in enumerate(sources) if cursors[i] < source.count]:
        chunks = {i: sources[i].read(cursors[i], window_rows) for i in live}
        more = [chunks[i][0][-1] for i in live if cursors[i] + len(chunks[i][0]) < sources[i].count]
        limit = min(more) if more else None
        taken_ids, taken_rows = [], []
        for i in live:
            ids, rows = chunks[i]
            n = len(ids) if limit is None else int(np.searchsorted(ids, limit, side="right"))
            taken_ids.append(ids[:n])
            taken_rows.append(rows[:n])
            cursors[i] += n
        ids = np.concatenate(taken_ids)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        if np.any(ids[1:] <= ids[:-1]) or (last is not None and len(ids) and ids[0] <= last):
            raise CheckpointError("a table's ids are repeated, or a server's are not sorted")
        write(position, ids, np.concatenate(taken_rows)[order])
        position, last = position + len(ids), (ids[-1] if len(ids) else last)
    return position


@dataclass
class OpenPart:
    """A server's part, verified and open: its file, metadata and tensors' places."""

    fd: int
    meta: dict[str, Any]
    stored: dict[str, Stored]

    def rows_of(self, table: str) -> SortedRows:
        """The part's rows of ``table`` (sorted by id for a fixed table)."""
        ids, values = self.stored.get(f"table/{table}/ids"), self.stored.get(f"table/{table}/value")
        if ids is None or values is None:
            raise CheckpointError(f"server {self.meta.get('server')}: no rows of table {table}")
        if ids.dtype != torch.int64 or len(ids.shape) != 1 or ids.shape[0] != values.shape[0]:
            raise CheckpointError(f"table {table}: ids are not one int64 per row")
        return SortedRows(self.fd, ids, values)


def export_checkpoint(found: Checkpoint, out: Path) -> int:
    """Write the model of checkpoint ``found`` to ``out`` (see the module doc); returns the
    number of tensors written. Raises :class:`CheckpointError` if the checkpoint has no server
    part or a part does not read back."""
    # The servers' parts first: they hold the tables (the trainers' dense part has none).
    names = sorted((n for n in found.part_names if is_model_part(n)), key=lambda n: n == DENSE_PART)
    if not names or names[0] == DENSE_PART:
        raise CheckpointError(f"{found.directory}: no server part to export")
    out = Path(out)
    with contextlib.ExitStack() as stack:
        parts = [_open_part(found, name, stack) for name in names]
        tmp = out.with_name(f".{out.name}.{secrets.token_hex(8)}.tmp")
        stack.callback(lambda: tmp.unlink(missing_ok=True))
        skeleton = _skeleton(parts)
        with FakeTensorMode():
            fakes = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in skeleton.items()}
        fakes.update({alias: fakes[table] for alias, table in _aliases(parts[0], fakes).items()})
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fakes, tmp)
        with open(tmp, "r+b") as f:
            places = stored_tensors(f, tmp)
            _fill(f.fileno(), parts, places, out.parent)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    return len(fakes)


def _aliases(part: OpenPart, tensors: dict[str, Any]) -> dict[str, str]:
    """The part's other names of tables (checkpoints written before they were kept have
    none), checked: each a new name of a table that is saved."""
    aliases = part.meta.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
        isinstance(alias, str) and alias not in tensors and table in tensors
        for alias, table in aliases.items()
    ):
        raise CheckpointError(f"server {part.meta.get('server')}: malformed aliases {aliases!r}")
    return aliases


def _open_part(found: Checkpoint, name: str, stack: contextlib.ExitStack) -> OpenPart:
    f, meta = stack.enter_context(found.open_part(name))
    return OpenPart(f.fileno(), meta, stored_tensors(f, found.directory / f"{name}.pt"))


def _skeleton(parts: list[OpenPart]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The output's tensors: name -> (shape, dtype), in state_dict order (dense, then tables)."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for part in parts:
        for name in part.meta["dense"]:
            value = part.stored[f"dense/{name}/value"]
            out[name] = (value.shape, value.dtype)
    for name, table in parts[0].meta["tables"].items():
        value = parts[0].rows_of(name).values
        rows = sum(part.rows_of(name).count for part in _holding(parts, name))
        out[name] = ((rows, *value.shape[1:]), value.dtype)
        if table["dynamic"]:
            out[_ids_key(name)] = ((rows,), torch.int64)
    return out


def _holding(parts: list[OpenPart], table: str) -> list[OpenPart]:
    """The parts that hold rows of ``table`` (every server's; not the trainers' dense part)."""
    return [part for part in parts if table in part.meta["tables"]]


def _ids_key(table: str) -> str:
    return table.removesuffix("weight") + "ids"


def _fill(fd: int, parts: list[OpenPart], places: dict[str, Stored], scratch: Path) -> None:
    """Write every tensor's bytes into the output file ``fd`` at ``places``."""
    for part in parts:
        for name in part.meta["dense"]:
            value = part.stored[f"dense/{name}/value"]
            write_bytes(fd, read_bytes(part.fd, value.offset, value.nbytes), places[name].offset)
    for name, table in parts[0].meta["tables"].items():
        ids_at = places[_ids_key(name)].offset if table["dynamic"] else None
        with _sorted_sources(_holding(parts, name), name, ids_at is not None, scratch) as sources:
            _write_table(fd, name, sources, places[name], ids_at)


def _write_table(
    fd: int, name: str, sources: list[SortedRows], weight: Stored, ids_at: int | None
) -> None:
    """Table ``name``'s rows from ``sources`` in id order into ``fd``: the rows at ``weight``,
    and the ids at ``ids_at`` (a dynamic table; a fixed one's ids must be 0..N-1)."""

    def write(first: int, ids: np.ndarray, rows: np.ndarray) -> None:
        if ids_at is None and (ids[0] != first or ids[-1] != first + len(ids) - 1):
            raise CheckpointError(f"table {name}: the servers' rows are not rows 0..N-1")
        write_bytes(fd, rows, weight.offset + first * weight.row_bytes)
        if ids_at is not None:
            write_bytes(fd, ids, ids_at + first * 8)

    window = max(1, WINDOW_BYTES // (max(1, weight.row_bytes) * len(sources)))
    merge_by_id(sources, write, window)


@contextlib.contextmanager
def _sorted_sources(
    parts: list[OpenPart], table: str, dynamic: bool, scratch: Path
) -> Iterator[list[SortedRows]]:
    """Each server's rows of ``table`` sorted by id: read in place for a fixed table (its
    parts hold rows in id order); for a dynamic one, sorted one shard at a time into a
    temporary file in ``scratch``, deleted afterwards."""
    if not dynamic:
        yield [part.rows_of(table) for part in parts]
        return
    with tempfile.TemporaryFile(dir=scratch) as runs:
        yield [_sorted_run(part.rows_of(table), runs) for part in parts]


def _sorted_run(rows: SortedRows, runs: IO[bytes]) -> SortedRows:
    """``rows`` sorted by id, appended to the file ``runs``: holds one table shard."""
    ids, values = rows.read(0, rows.count)
    order = np.argsort(ids, kind="stable")
    runs.seek(0, os.SEEK_END)
    ids_at = runs.tell()
    runs.write(ids[order].data)
    values_at = runs.tell()
    window = max(1, WINDOW_BYTES // max(1, rows.values.row_bytes))
    for start in range(0, len(order), window):
        runs.write(values[order[start : start + window]].data)
    runs.flush()
    fd = runs.fileno()
    return SortedRows(
        fd,
        Stored(ids_at, torch.int64, (rows.count,)),
        Stored(values_at, rows.values.dtype, rows.values.shape),
    )
