"""One segment of a training server's change log: what changed on it between two cuts.

A segment holds, for each table, the ids of the rows written since the server's previous cut
with their current values (weights only), and the ids removed (a dynamic table's evictions,
expiries and deletes: tombstones); and the dense parameters written, with their values. Each id
is in a segment at most once, as a row or as a tombstone (the last thing that happened to it).

The file, written once and never changed::

    MAGIC (8 bytes) | header length (8 bytes, little-endian) | header (JSON) | payload | digest

The header (:class:`SegmentHeader`) says where the segment sits in its server's chain
(``sequence``, ``previous``), what it covers (the server's steps, the store's change
sequence) and, for each tensor of the payload, its place, dtype and shape. The digest is
BLAKE2b-256 of every byte before it: a truncated or damaged file fails it. A reader that
accepts a segment (:func:`read_segment`) has checked every field, every tensor's bounds and
that no id appears twice; anything else is a :class:`~paramserver.errors.ChangeLogError`
naming the file.

Values travel with a codec (``none``, ``bf16``, ``int8``: int8 per row with a bf16 scale,
:mod:`paramserver.wire.compression`), per table as the encoder chose it (a bf16 value out of
bf16's range falls back to ``none``); dense values are always ``none``.

A segment may also hold a recovery section (:class:`Recovery`), which serving skips: what its
server's store needs, beyond the values, to be rebuilt from a checkpoint and the segments
since (:mod:`paramserver.changelog.recover`): the changed rows whole (value, optimizer state,
step counts, versions, last touch, exactly), dynamic tables' pending ids and counters, the
changed dense values' state, and the store's clock.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import Tensor

from paramserver.errors import ChangeLogError
from paramserver.wire.compression import Encoded, decode, encode

MAGIC = b"PSLOG\x00\x01\n"
SEGMENT_CODECS = ("none", "bf16", "int8")
_DIGEST_BYTES = 32
_LENGTH = struct.Struct("<Q")
_ALIGN = 8
_MAX_HEADER_BYTES = 64 << 20
_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_HEADER_KEYS = {
    "writer", "server", "sequence", "previous", "first_step", "last_step", "after_changes",
    "changes", "cut_at", "first_change_at", "aligned", "servers", "full", "tables", "dense",
    "tensors", "recovery",
}  # fmt: skip
# The tensors a table may have in a segment, by role.
_ROLES = ("ids", "values", "scales", "removed")
# Those of a table's recovery section (a snapshot's entries), and of a dense value's.
_RECOVERY_ROLE = re.compile(r"ids|value|steps|versions|last_touched|state\.\w+|"
                            r"pending\.(ids|counts|seen|latest|forgotten)")  # fmt: skip
_DENSE_RECOVERY_ROLE = re.compile(r"value|version|state\.\w+")


@dataclass
class TableChanges:
    """One table's part of a segment: ``ids`` (unique) with their rows' ``values``
    (``[len(ids), dim]``, float32 once read), and the ids ``removed`` (unique, none of
    ``ids``)."""

    ids: Tensor
    values: Tensor
    removed: Tensor


@dataclass
class Recovery:
    """A segment's recovery section (see the module doc): ``tables[name]``, the table's
    partial snapshot (:meth:`~paramserver.store.store.Store.snapshot_of`'s entries) with its
    metadata in ``meta[name]``; ``dense[name]``, a dense value with ``state.<slot>`` and
    ``version``; ``clock``, the store's clock at the cut; ``books``, the server's."""

    clock: int
    tables: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    dense: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    # The server's books at the cut, as JSON (each trainer's newest call taken, those that
    # left): what it needs to take each call exactly once after a recovery.
    books: dict[str, Any] = field(default_factory=dict)


@dataclass
class Segment:
    """A segment's content (see the module doc) and where it sits: ``sequence`` in the chain
    of server ``server``, written by ``writer`` (the server process: host and pid), after
    ``previous`` (0: the chain's first); it covers
    the server's steps ``first_step`` to ``last_step`` (none where ``first_step`` is
    ``last_step + 1``: a cut with no step since the last) and its store's changes after
    ``after_changes`` up to ``changes`` (the change feed's sequence numbers). ``servers``:
    the job's server count. ``full``: it holds every row and dense value the server has, not
    only what changed: it replaces the server's part whatever came before (a job resumed
    from a checkpoint older than its log's end publishes one first)."""

    writer: str
    server: int
    sequence: int
    previous: int
    first_step: int
    last_step: int
    after_changes: int
    changes: int
    cut_at: float = 0.0  # when it was cut (time.time()): how old what it holds is
    first_change_at: float = 0.0  # when its oldest change was made (0: it holds none)
    # Cut at a sync round's end that every server cut at: serving applies the segments of
    # one step on all servers together (a version is the model after that step).
    aligned: bool = False
    servers: int = 1
    full: bool = False
    tables: dict[str, TableChanges] = field(default_factory=dict)
    dense: dict[str, Tensor] = field(default_factory=dict)
    recovery: Recovery | None = None

    @property
    def num_rows(self) -> int:
        return sum(t.ids.numel() for t in self.tables.values())

    @property
    def num_removed(self) -> int:
        return sum(t.removed.numel() for t in self.tables.values())


def write_segment(f: IO[bytes], segment: Segment, codec: str = "none") -> None:
    """Write ``segment`` to ``f`` (see the module doc), its rows' values encoded with
    ``codec``."""
    if codec not in SEGMENT_CODECS:
        raise ValueError(f"segment codec {codec!r}: choose from {SEGMENT_CODECS}")
    placed: list[dict[str, Any]] = []
    payload: list[memoryview] = []
    offset = 0

    def place(entry: dict[str, Any], tensor: Tensor) -> None:
        nonlocal offset
        data = _bytes_of(tensor)
        placed.append({**entry, "dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "offset": offset})  # fmt: skip
        payload.append(data)
        padded = _aligned(data.nbytes)
        if padded > data.nbytes:
            payload.append(memoryview(bytes(padded - data.nbytes)))
        offset += padded

    tables = {}
    for name, changes in segment.tables.items():
        encoded = encode(codec, changes.values.float().contiguous())
        rows, removed = changes.ids.numel(), changes.removed.numel()
        dim = _dim(changes.values)
        tables[name] = {"codec": encoded.codec, "rows": rows, "removed": removed, "dim": dim}
        place({"table": name, "role": "ids"}, changes.ids)
        for role, tensor in zip(("values", "scales"), encoded.tensors, strict=False):
            place({"table": name, "role": role}, tensor)
        place({"table": name, "role": "removed"}, changes.removed)
    for name, value in segment.dense.items():
        place({"dense": name}, value.float().contiguous())
    recovery = segment.recovery
    if recovery is not None:
        sections = (("recovery", recovery.tables), ("recovery_dense", recovery.dense))
        for kind, section in sections:
            for name, entries in section.items():
                for role, tensor in entries.items():
                    place({kind: name, "role": role}, tensor.contiguous())
    header = _header_of(segment, tables, placed)
    digest = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    parts: list[bytes | memoryview] = [MAGIC, *_header_bytes(header), *payload]
    for part in parts:
        digest.update(part)
        f.write(part)
    f.write(digest.digest())


def _header_of(
    segment: Segment, tables: dict[str, Any], placed: list[dict[str, Any]]
) -> dict[str, Any]:
    recovery = segment.recovery
    return {
        "writer": segment.writer, "server": segment.server, "sequence": segment.sequence,
        "previous": segment.previous, "first_step": segment.first_step,
        "last_step": segment.last_step, "after_changes": segment.after_changes,
        "changes": segment.changes, "cut_at": segment.cut_at,
        "first_change_at": segment.first_change_at, "aligned": segment.aligned,
        "servers": segment.servers, "full": segment.full, "tables": tables,
        "dense": list(segment.dense), "tensors": placed,
        "recovery": None if recovery is None else {
            "clock": recovery.clock,
            "tables": {name: recovery.meta.get(name, {}) for name in recovery.tables},
            "dense": list(recovery.dense),
            "books": recovery.books,
        },
    }  # fmt: skip


def read_segment(path: str | Path) -> Segment:
    """The segment at ``path``, every part checked (see the module doc); a ChangeLogError
    naming the file for anything else."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ChangeLogError(f"change log segment {path}: cannot read it: {error}") from None
    try:
        return _parse(data)
    except _Bad as bad:
        raise ChangeLogError(f"change log segment {path}: {bad}") from None


class _Bad(Exception):
    """What is wrong with a segment's bytes (the reader adds the file's name)."""


def _parse(data: bytes) -> Segment:
    fixed = len(MAGIC) + _LENGTH.size
    if len(data) < fixed + _DIGEST_BYTES or data[: len(MAGIC)] != MAGIC:
        raise _Bad("not a segment (bad magic or too short)")
    body, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest() != digest:
        raise _Bad("digest mismatch: the file is truncated or damaged")
    (header_length,) = _LENGTH.unpack_from(body, len(MAGIC))
    if header_length > min(_MAX_HEADER_BYTES, len(body) - fixed):
        raise _Bad(f"header length {header_length} runs past the file")
    try:
        header = json.loads(body[fixed : fixed + header_length])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _Bad(f"header is not JSON: {error}") from None
    _check_header(header)
    payload = memoryview(body)[fixed + header_length :]
    kept = _HEADER_KEYS - {"tables", "dense", "tensors", "recovery"}
    segment = Segment(**{k: header[k] for k in kept})
    found = _tensors(header["tensors"], payload)
    for name, counts in header["tables"].items():
        segment.tables[name] = _table(name, counts, found)
    for name in header["dense"]:
        if (name,) not in found:
            raise _Bad(f"dense parameter {name!r} has no tensor")
        segment.dense[name] = found.pop((name,))
    if header["recovery"] is not None:
        segment.recovery = _recovery(header["recovery"], found)
    if found:
        raise _Bad(f"tensors that no table or dense parameter names: {sorted(found)[:3]}")
    return segment


def _check_header(header: Any) -> None:
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise _Bad(f"header must have the keys {sorted(_HEADER_KEYS)}, has {got}")
    if not isinstance(header["writer"], str):
        raise _Bad("header: writer must be a string")
    for key in ("cut_at", "first_change_at"):
        if type(header[key]) not in (int, float) or not header[key] >= 0:
            raise _Bad(f"header: {key} must be a time >= 0, got {header[key]!r}")
    for key in ("aligned", "full"):
        if not isinstance(header[key], bool):
            raise _Bad(f"header: {key} must be true or false")
    times = {"cut_at", "first_change_at"}
    flags = {"writer", "aligned", "full", "tables", "dense", "tensors", "recovery"}
    for key in _HEADER_KEYS - times - flags:
        if type(header[key]) is not int or header[key] < 0:
            raise _Bad(f"header: {key} must be an integer >= 0, got {header[key]!r}")
    if not isinstance(header["tables"], dict) or not isinstance(header["dense"], list):
        raise _Bad("header: tables must be an object and dense a list")
    if not isinstance(header["tensors"], list):
        raise _Bad("header: tensors must be a list")
    _check_order(header)


def _check_order(header: dict[str, Any]) -> None:
    if not header["server"] < header["servers"]:
        raise _Bad(f"header: server {header['server']} of {header['servers']} servers")
    if not header["previous"] < header["sequence"]:
        raise _Bad(f"header: previous {header['previous']} is not before {header['sequence']}")
    if not header["after_changes"] <= header["changes"]:
        raise _Bad("header: after_changes is past changes")


def _tensors(entries: list[Any], payload: memoryview) -> dict[tuple[str, ...], Tensor]:
    """The payload's tensors by (table, role) or (dense name,), each checked to lie within
    the payload with its dtype and shape."""
    found: dict[tuple[str, ...], Tensor] = {}
    for entry in entries:
        key, tensor = _tensor(entry, payload)
        if key in found:
            raise _Bad(f"tensor {key} appears twice")
        found[key] = tensor
    return found


def _tensor(entry: Any, payload: memoryview) -> tuple[tuple[str, ...], Tensor]:
    if not isinstance(entry, dict):
        raise _Bad("a tensor entry must be an object")
    key: tuple[str, ...]
    if "dense" in entry and isinstance(entry["dense"], str):
        key = (entry["dense"],)
    elif isinstance(entry.get("table"), str) and entry.get("role") in _ROLES:
        key = (entry["table"], entry["role"])
    elif _recovery_entry(entry, "recovery", _RECOVERY_ROLE):
        key = ("recovery", entry["recovery"], entry["role"])
    elif _recovery_entry(entry, "recovery_dense", _DENSE_RECOVERY_ROLE):
        key = ("recovery_dense", entry["recovery_dense"], entry["role"])
    else:
        raise _Bad(f"tensor entry {entry!r} names no table role or dense parameter")
    dtype, shape, offset = entry.get("dtype"), entry.get("shape"), entry.get("offset")
    if dtype not in _DTYPES or not isinstance(shape, list) or type(offset) is not int:
        raise _Bad(f"tensor {key}: bad dtype, shape or offset")
    if not all(type(n) is int and n >= 0 for n in shape) or len(shape) > 8:
        raise _Bad(f"tensor {key}: bad shape {shape}")
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if offset < 0 or offset % _ALIGN or offset + nbytes > len(payload):
        raise _Bad(f"tensor {key}: bytes {offset}..{offset + nbytes} outside the payload")
    if not nbytes:
        return key, torch.empty(shape, dtype=_DTYPES[dtype])
    raw = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=offset).copy()
    return key, torch.from_numpy(raw).view(_DTYPES[dtype]).reshape(shape)


def _table(name: str, counts: Any, found: dict[tuple[str, ...], Tensor]) -> TableChanges:
    """Table ``name``'s changes from its tensors in ``found`` (taken out), decoded and
    checked against ``counts`` (its header entry)."""
    if not isinstance(counts, dict) or counts.get("codec") not in SEGMENT_CODECS:
        raise _Bad(f"table {name!r}: bad header entry {counts!r}")
    if not all(type(counts.get(k)) is int and counts[k] >= 0 for k in ("rows", "removed", "dim")):
        raise _Bad(f"table {name!r}: rows, removed and dim must be integers >= 0")
    rows: int = counts["rows"]
    removed: int = counts["removed"]
    dim: int = counts["dim"]
    parts = {role: found.pop((name, role), None) for role in _ROLES}
    ids, values, removed_ids = parts["ids"], parts["values"], parts["removed"]
    if ids is None or values is None or removed_ids is None:
        raise _Bad(f"table {name!r}: ids, values or removed missing")
    if ids.dtype != torch.int64 or removed_ids.dtype != torch.int64:
        raise _Bad(f"table {name!r}: ids must be int64")
    if tuple(ids.shape) != (rows,) or tuple(removed_ids.shape) != (removed,):
        raise _Bad(f"table {name!r}: ids do not match the header's counts")
    codec, scales = counts["codec"], parts["scales"]
    value_dtype = {"none": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[codec]
    if values.dtype != value_dtype or tuple(values.shape) != (rows, dim):
        raise _Bad(f"table {name!r}: values must be {value_dtype} [{rows}, {dim}]")
    if (codec == "int8") != (scales is not None):
        raise _Bad(f"table {name!r}: scales go with int8 values, and only with them")
    if scales is not None and (scales.dtype != torch.bfloat16 or tuple(scales.shape) != (rows,)):
        raise _Bad(f"table {name!r}: int8 scales must be bfloat16 [{rows}]")
    everything = torch.cat([ids, removed_ids])
    if everything.unique().numel() != everything.numel():
        raise _Bad(f"table {name!r}: an id appears more than once")
    tensors = (values,) if scales is None else (values, scales)
    decoded = decode(Encoded(codec, (rows, dim), tensors))
    return TableChanges(ids, decoded.float(), removed_ids)


def _recovery_entry(entry: dict[str, Any], kind: str, roles: re.Pattern[str]) -> bool:
    role = entry.get("role")
    return (
        isinstance(entry.get(kind), str) and isinstance(role, str) and bool(roles.fullmatch(role))
    )


def _recovery(described: Any, found: dict[tuple[str, ...], Tensor]) -> Recovery:
    """The recovery section ``described`` (its header entry), its tensors taken from
    ``found``, each table's checked: unique int64 ids, one row of each per-row tensor per
    id, the same of its pending ids, and integer counters."""
    if not (
        isinstance(described, dict) and set(described) == {"clock", "tables", "dense", "books"}
        and type(described["clock"]) is int and isinstance(described["tables"], dict)
        and isinstance(described["dense"], list) and isinstance(described["books"], dict)
    ):  # fmt: skip
        raise _Bad(f"recovery: bad header entry {described!r}"[:200])
    recovery = Recovery(described["clock"], books=described["books"])
    for name, meta in described["tables"].items():
        entries = {key[2]: found.pop(key) for key in list(found) if key[:2] == ("recovery", name)}
        _check_snapshot(name, entries, meta)
        recovery.tables[name], recovery.meta[name] = entries, meta
    for name in described["dense"]:
        key = ("recovery_dense", name)
        entries = {k[2]: found.pop(k) for k in list(found) if k[:2] == key}
        if "value" not in entries or "version" not in entries:
            raise _Bad(f"recovery: dense parameter {name!r} lacks its value or version")
        recovery.dense[name] = entries
    return recovery


def _check_snapshot(name: str, entries: dict[str, Tensor], meta: Any) -> None:
    """A table's recovery entries: unique 1-D int64 ``ids`` and ``pending.ids``, one entry of
    each per-row tensor per id (of the pending ids for ``pending.*``), values with rows."""
    where = f"recovery of table {name!r}"
    for ids_role in ("ids", "pending.ids", "pending.forgotten"):
        ids = entries.get(ids_role)
        if ids is not None and (
            ids.dtype != torch.int64 or ids.dim() != 1 or ids.unique().numel() != ids.numel()
        ):
            raise _Bad(f"{where}: {ids_role} must be unique 1-D int64 ids")
    for role, tensor in entries.items():
        if role == "pending.forgotten":
            continue
        of = "pending.ids" if role.startswith("pending.") else "ids"
        ids = entries.get(of)
        if ids is None or tensor.dim() == 0 or tensor.shape[0] != ids.numel():
            raise _Bad(f"{where}: {role} has not one entry per id of {of}")
    if "ids" in entries and "value" not in entries:
        raise _Bad(f"{where}: rows without values")
    counters = meta.get("counters", {}) if isinstance(meta, dict) else None
    if not isinstance(counters, dict) or not all(type(v) is int for v in counters.values()):
        raise _Bad(f"{where}: bad metadata")


def _header_bytes(header: Mapping[str, Any]) -> tuple[bytes, bytes]:
    text = json.dumps(header, separators=(",", ":")).encode()
    return _LENGTH.pack(len(text)), text


def _bytes_of(tensor: Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().view(np.uint8).data


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _dim(values: Tensor) -> int:
    return int(values.shape[1]) if values.dim() == 2 else 0
