"""A server's checks of a request, before anything in it is applied or read: its header's field
types, its size against the cap, its packed ids and encoded gradients decoded, and its contents
validated whole (a refused request changes nothing).

:class:`RequestChecks` takes a request through them, one method a step, for a
:class:`~paramserver.server.shard.ServerShard`, over its dense parameters and tables. The
steps share three kinds of check: the header's (:func:`~paramserver.server.header.check_header`),
the row ids' (:class:`IdChecks`: plain, in range, on this server, sorted and unique) and the
values' (:class:`ValueChecks`: a tensor's form, its finiteness, an encoding); the size cap is
:class:`SizeCap`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, TypeGuard

import torch
from torch import Tensor

from paramserver import native
from paramserver.config import GRADIENT_CODECS, VALUE_CODECS
from paramserver.errors import ParamServerError
from paramserver.server.header import check_header
from paramserver.server.idchecks import IdChecks, reject
from paramserver.sharding import ShardPlan
from paramserver.store.table import TableShard
from paramserver.wire.bundles import joined_already
from paramserver.wire.compression import Encoded, decode, validate
from paramserver.wire.idcodec import (
    PackedIds,
    PackedTables,
    TablesProblem,
    num_ids,
    packed_problem,
    unpack_all,
    unpack_tables,
)
from paramserver.wire.messages import BagBlock, PushPullRequest, RowBlock
from paramserver.wire.sizing import message_nbytes, message_sizes, payload_nbytes


class HasValue(Protocol):
    """A dense parameter's slot as the checks see it: its value's shape and dtype."""

    value: Tensor


class RequestChecks:
    """The checks of server ``server``'s requests, against its ``dense`` parameters (slots
    with a ``value``) and ``tables`` (read only: no lock is needed); thread-safe."""

    def __init__(
        self,
        server: int,
        plan: ShardPlan,
        dense: Mapping[str, HasValue],
        tables: Mapping[str, TableShard],
        cache_lag: int | None,
    ):
        self.server = server
        self.plan = plan
        self.dense = dense
        self.tables = tables
        self.cache_lag = cache_lag
        self.sizes = SizeCap(server, tables)
        self.ids = IdChecks(server, plan, tables)
        self.values = ValueChecks(server, dense)

    def check_header(self, request: object, num_trainers: int) -> None:
        """Reject a request whose fields are not of the types the protocol defines (first of
        all: the other checks read them), from a trainer outside ``num_trainers``."""
        check_header(request, self.server, num_trainers)

    def expand(self, request: PushPullRequest, max_bytes: int) -> int:
        """Turn a trainer's ids packed together (``packed_pulls``, ``packed_grads``) into the
        mappings per table of ``pull_rows`` and ``row_grads``, which any peer may send
        instead, before anything reads them (after the header's check); a table whose row
        gradients have no ids is left out. Raise :class:`InvalidPushError` where a table's
        ids are malformed (naming it), where they name a table the mappings do too, or where
        they would take over ``max_bytes`` once unpacked (at most 8 bytes of ids per byte
        packed); ParamServerError where the packing as a whole is. Returns what the packed
        fields weighed on the wire less what their ids weigh unpacked (so that
        :meth:`check_size` counts the bytes as sent)."""
        weighed = 0
        pulls, blocks = request.packed_pulls, request.packed_grads
        if pulls is not None:
            ids, weighed = self._unpacked_tables("packed_pulls", pulls, max_bytes)
            self._join(request.pull_rows, ids)
            request.packed_pulls = None
        if blocks is not None:
            ids, difference = self._unpacked_tables("packed_grads", blocks.ids, max_bytes)
            weighed += difference
            values = blocks.values
            if values.keys() != ids.keys():
                raise ParamServerError(
                    f"server {self.server}: malformed request: packed_grads' values name "
                    "other tables than their ids"
                )
            rows = {name: RowBlock(i, values[name]) for name, i in ids.items() if i.numel()}
            self._join(request.row_grads, rows)
            request.packed_grads = None
        return weighed

    def _join(self, mapping: dict[str, Any], unpacked: dict[str, Any]) -> None:
        twice = mapping.keys() & unpacked.keys()
        if twice:
            raise reject(self.server, min(twice), "sent both packed together and alone")
        mapping.update(unpacked)

    def _unpacked_tables(
        self, field: str, packed: PackedTables, max_bytes: int
    ) -> tuple[dict[str, Tensor], int]:
        data = getattr(packed, "data", None)
        if type(data) is Tensor and 8 * data.numel() > max_bytes:
            raise reject(
                self.server,
                None,
                f"{field}: packed ids of {data.numel()} bytes may unpack past the cap of "
                f"{max_bytes} bytes (--max-message-mb)",
            )
        found = unpack_tables(packed)
        if type(found) is TablesProblem:
            if found.table is None:
                raise ParamServerError(
                    f"server {self.server}: malformed request: {field}: {found.reason}"
                )
            raise reject(self.server, found.table, f"malformed packed ids: {found.reason}")
        assert type(found) is dict and type(data) is Tensor
        return found, payload_nbytes(packed) - 8 * sum(ids.numel() for ids in found.values())

    def check_size(self, request: PushPullRequest, max_bytes: int) -> int:
        """Refuse a call that would make this server hold over ``max_bytes`` for it, before
        anything in it is decoded or read; returns its bytes on the wire (see
        :meth:`SizeCap.check`)."""
        return self.sizes.check(request, max_bytes)

    def decode_request(self, request: PushPullRequest) -> None:
        """Replace packed row ids by int64 ids and encoded gradients by their float32 values
        (before :meth:`validate`), the one place a request's ids and gradients are decoded
        (pooled ones: as they are expanded); raise :class:`InvalidPushError` for packed ids
        that are malformed (checked before they are unpacked, and first of all), for an
        encoding that does not stand for the expected shape, in a codec trainers use there,
        or for row ids that are invalid (checked before a row gradient is decoded: they set
        the size it decodes to). A request without gradients has its ids unpacked alone."""
        self._unpack_ids(request)
        for name, grad in request.dense_grads.items():
            slot = self.dense.get(name)
            if type(grad) is Encoded and slot is not None:
                shape = tuple(slot.value.shape)
                request.dense_grads[name] = self.values.decoded(name, grad, shape)
        for name, block in request.row_grads.items():
            table = self.tables.get(name)
            if type(block) is RowBlock and type(block.values) is Encoded and table is not None:
                self.ids.check(name, table, block.ids, sorted_unique=True)
                shape = (num_ids(block.ids), table.spec.dim)
                block.values = self.values.decoded(name, block.values, shape)

    def _unpack_ids(self, request: PushPullRequest) -> None:
        """Unpack the packed ids of row gradients and pulls, all checked first (the first
        malformed one, in that order, is refused) and unpacked together; others stay as they
        are (plain ids, or anything else, which :meth:`validate` refuses)."""
        blocks = [
            (name, block)
            for name, block in request.row_grads.items()
            if type(block) is RowBlock and type(block.ids) is PackedIds
        ]
        pulls = [name for name, ids in request.pull_rows.items() if type(ids) is PackedIds]
        sets = [block.ids for _, block in blocks] + [request.pull_rows[name] for name in pulls]
        if not sets:
            return
        unpacked, malformed = unpack_all(sets)
        if malformed >= 0:
            names = [name for name, _ in blocks] + pulls
            problem = packed_problem(sets[malformed])
            raise reject(self.server, names[malformed], f"malformed packed ids: {problem}")
        each = iter(unpacked)
        for _, block in blocks:
            block.ids = next(each)
        for name in pulls:
            request.pull_rows[name] = next(each)

    def pooled_grads(self, name: str, grads: object, num_bags: int) -> Tensor:
        """The gradient of ``num_bags`` pooled sums of table ``name`` (one this server answered
        a pooled pull of), decoded and checked; raises :class:`InvalidPushError`."""
        table = self.tables[name]
        shape = (num_bags, table.spec.dim)
        if type(grads) is Encoded:
            grads = self.values.decoded(name, grads, shape)
        return self.values.tensor(name, grads, shape, table.weight.dtype)

    def validate(self, request: PushPullRequest) -> None:
        """Raise :class:`InvalidPushError` if any part of ``request`` is malformed.

        The request's header (field types) was checked by the coordinator; this checks contents:
        the gradients, then the reads.
        """
        ids_valid = self.ids.all_valid(request)
        self._check_buffers(request)
        self._check_grads(request, ids_valid)
        self._check_reads(request, ids_valid)

    def _check_buffers(self, request: PushPullRequest) -> None:
        """The buffers a request sets: only the chief's (trainer 0's: its buffers are the
        model's), each one placed here, of its shape and dtype (any values: a statistic may
        be what it is)."""
        for name, value in request.buffers.items():
            if request.trainer != 0:
                raise reject(
                    self.server, name, f"trainer {request.trainer} sent a buffer: only the "
                    "chief trainer (0) sets buffers"
                )  # fmt: skip
            if self.plan.buffer_server.get(name) != self.server:
                where = self.plan.buffer_server.get(name)
                reason = "unknown buffer" if where is None else f"buffer lives on server {where}"
                raise reject(self.server, name, reason)
            held = self.dense[name].value
            if not isinstance(value, Tensor) or value.layout != torch.strided:
                raise reject(self.server, name, "a buffer must be a plain dense tensor")
            if not value.is_cpu or value.requires_grad:
                raise reject(self.server, name, "a buffer must be a CPU tensor without autograd")
            if value.dtype != held.dtype or value.shape != held.shape:
                raise reject(
                    self.server, name, f"buffer of {value.dtype} {tuple(value.shape)} != the "
                    f"model's {held.dtype} {tuple(held.shape)}"
                )  # fmt: skip

    def _check_grads(self, request: PushPullRequest, ids_valid: bool = False) -> None:
        """The gradients' checks (their ids' skipped where ``ids_valid`` says they pass)."""
        grads: dict[str, Tensor] = {}
        for name, grad in request.dense_grads.items():
            slot = self.dense.get(name)
            if slot is None or name in self.plan.buffers:
                raise reject(self.server, name, self.ids.not_here(name))
            grads[name] = self.values.tensor(
                name, grad, slot.value.shape, slot.value.dtype, finite=False
            )
        for name, block in request.row_grads.items():
            table = self.ids.table(name)
            if type(block) is not RowBlock:
                raise reject(self.server, name, "malformed row gradients: expected a RowBlock")
            if not ids_valid:
                self.ids.check(name, table, block.ids, sorted_unique=True)
            shape = (num_ids(block.ids), table.spec.dim)
            grads[name] = self.values.tensor(
                name, block.values, shape, table.weight.dtype, finite=False
            )
        self.values.check_finite(grads)

    def _check_reads(self, request: PushPullRequest, ids_valid: bool = False) -> None:
        """The reads' checks (the pulled ids' skipped where ``ids_valid`` says they pass)."""
        for name, ids in request.pull_rows.items():
            table = self.ids.table(name)
            if not ids_valid:
                self.ids.check(name, table, ids, sorted_unique=True)
        for name, cached in request.pull_versions.items():
            pulled = request.pull_rows.get(name)
            if pulled is None or self.cache_lag is None:
                raise reject(self.server, name, "cached versions without a pull, or caching is off")
            if not _one_per_id(cached, torch.int64, pulled) or (
                cached.numel() and int(cached.min()) < -1
            ):
                raise reject(self.server, name, "cached versions must be int64 >= -1, one per id")
        for name, mask in request.pull_state.items():
            pulled = request.pull_rows.get(name)
            if pulled is None:
                raise reject(self.server, name, "row state asked without a pull")
            if not _one_per_id(mask, torch.bool, pulled):
                raise reject(
                    self.server,
                    name,
                    "the rows whose state to answer must be a bool mask, one per id",
                )
        for name, bags in request.pool_rows.items():
            self._check_bags(name, self.ids.table(name), bags)

    def _check_bags(self, name: str, table: TableShard, block: object) -> None:
        if type(block) is not BagBlock or type(block.num_bags) is not int:
            raise reject(self.server, name, "malformed bags: expected a BagBlock")
        if block.num_bags < 0:  # its size is capped with the answer's (check_size)
            raise reject(self.server, name, f"negative num_bags {block.num_bags}")
        self.ids.check(name, table, block.ids, sorted_unique=False)
        count = block.ids.numel()
        bags = block.bags
        if (
            not isinstance(bags, Tensor)
            or bags.dtype != torch.int64
            or tuple(bags.shape) != (count,)
            or bags.layout != torch.strided
            or not bags.is_cpu
        ):
            raise reject(self.server, name, "bag indices must be int64, one per id")
        if count and (int(bags.min()) < 0 or int(bags.max()) >= block.num_bags):
            raise reject(self.server, name, f"bag index outside [0, {block.num_bags})")
        if block.weights is not None:
            self.values.tensor(name, block.weights, (count,), table.weight.dtype)


class SizeCap:
    """The cap on what one call makes server ``server`` hold (``--max-message-mb``), measured
    against its ``tables``; thread-safe."""

    def __init__(self, server: int, tables: Mapping[str, TableShard]):
        self.server = server
        self.tables = tables

    def check(self, request: PushPullRequest, max_bytes: int) -> int:
        """Refuse a call that would make this server hold over ``max_bytes`` for it; returns
        its bytes on the wire (measured in the same walk:
        :func:`~paramserver.wire.sizing.message_sizes`).

        Two measures, each against ``max_bytes``: the request with its tensors decoded, and
        the rows its answer reads (``n`` ids of a ``dim``-wide table read ``n x dim`` values
        however few are sent; a pooled pull also reads a row per id, then ``num_bags x dim``
        sums). Dense values are not counted: their size is the model's, not the caller's. Only
        the request's header (field types) must have been checked; malformed contents count 0
        here and are refused by :meth:`RequestChecks.validate`.
        """
        held, sent = message_sizes(request)
        if held > max_bytes:
            raise reject(
                self.server,
                _largest(self._request_nbytes(request)),
                f"a call holding {held} bytes once decoded exceeds the cap of {max_bytes} "
                "bytes (--max-message-mb)",
            )
        answer = self._answer_nbytes(request)
        read = sum(answer.values())
        if read > max_bytes:
            raise reject(
                self.server,
                _largest(answer),
                f"an answer reading {read} bytes of rows exceeds the cap of {max_bytes} bytes "
                "(--max-message-mb)",
            )
        return sent

    @staticmethod
    def _request_nbytes(request: PushPullRequest) -> dict[str, int]:
        """:func:`message_nbytes` of each parameter's parts of ``request``."""
        sizes: dict[str, int] = {}
        for part in (
            request.dense_grads,
            request.row_grads,
            request.pull_rows,
            request.pull_versions,
            request.pool_rows,
            request.pooled_grads,
        ):
            for name, value in part.items():
                sizes[name] = sizes.get(name, 0) + message_nbytes(value)
        return sizes

    def _answer_nbytes(self, request: PushPullRequest) -> dict[str, int]:
        """Bytes of rows each table's part of the answer reads (see :meth:`check`)."""
        sizes: dict[str, int] = {}
        for name, ids in request.pull_rows.items():
            table = self.tables.get(name)
            if table is not None:
                version_bytes = 8 if name in request.pull_versions else 0
                per_id = table.spec.dim * table.weight.element_size() + version_bytes
                sizes[name] = num_ids(ids) * per_id
                mask = request.pull_state.get(name)
                if isinstance(mask, Tensor) and mask.dtype == torch.bool:
                    sizes[name] += int(mask.sum()) * table.arena.state_row_nbytes()
        for name, block in request.pool_rows.items():
            table = self.tables.get(name)
            if (
                table is not None
                and type(block) is BagBlock
                and isinstance(block.ids, Tensor)
                and type(block.num_bags) is int
            ):
                rows = block.ids.numel() + max(block.num_bags, 0)
                row_bytes = table.spec.dim * table.weight.element_size()
                sizes[name] = sizes.get(name, 0) + rows * row_bytes
        return sizes


class ValueChecks:
    """The checks of the values a request carries, for server ``server`` holding the ``dense``
    parameters named: each a plain CPU tensor of the expected shape and dtype, without NaN or
    Inf, and an encoding in a codec trainers use there; thread-safe."""

    def __init__(self, server: int, dense: Mapping[str, HasValue]):
        self.server = server
        self.dense = dense

    def decoded(self, name: str, encoded: Encoded, shape: tuple[int, ...]) -> Tensor:
        """``encoded`` decoded, once checked to stand for ``shape`` in a codec trainers use
        for ``name``: any for a dense gradient, no top-k for rows or pooled vectors."""
        codecs = GRADIENT_CODECS if name in self.dense else VALUE_CODECS
        problem = validate(encoded, shape, codecs)
        if problem is not None:
            raise reject(self.server, name, f"malformed encoding: {problem}")
        return decode(encoded)

    def tensor(
        self,
        name: str,
        value: object,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        *,
        finite: bool = True,
    ) -> Tensor:
        """``value``, refused unless it is a plain CPU tensor of ``shape`` and ``dtype`` that
        (``finite``; else the caller checks it) holds no NaN or Inf."""
        if not isinstance(value, Tensor):
            raise reject(self.server, name, f"expected a tensor, got {type(value).__name__}")
        if value.layout != torch.strided or not value.is_cpu or value.requires_grad:
            raise reject(self.server, name, "expected a plain dense CPU tensor without autograd")
        if value.dtype != dtype:
            raise reject(
                self.server, name, f"gradient dtype {value.dtype} != parameter dtype {dtype}"
            )
        if tuple(value.shape) != tuple(shape):
            raise reject(
                self.server,
                name,
                f"gradient shape {tuple(value.shape)} != expected {tuple(shape)}",
            )
        if finite:
            self.check_finite({name: value})
        return value

    def check_finite(self, tensors: Mapping[str, Tensor]) -> None:
        """Refuse a request whose ``tensors`` (checked, each a plain CPU tensor) hold a NaN or
        Inf, naming the first that does: all looked at together (:func:`_all_finite`; not one
        call per tensor: a request has dozens), one by one only if that finds one."""
        if _all_finite(list(tensors.values())):
            return
        for name, tensor in tensors.items():
            if not math.isfinite(float(tensor.sum())) and not bool(tensor.isfinite().all()):
                raise reject(self.server, name, "gradient contains NaN or Inf")


def _one_per_id(values: object, dtype: torch.dtype, ids: Tensor | PackedIds) -> TypeGuard[Tensor]:
    """Whether ``values`` is a plain CPU tensor of ``dtype`` with one entry per id of ``ids``."""
    return (
        isinstance(values, Tensor)
        and values.dtype == dtype
        and tuple(values.shape) == (num_ids(ids),)
        and values.layout == torch.strided
        and values.is_cpu
    )


def _largest(sizes: dict[str, int]) -> str | None:
    """The name with the most bytes, to name in an error (None if there is none)."""
    return max(sizes, key=lambda name: sizes[name]) if sizes else None


def _all_finite(tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` (plain CPU tensors) hold no NaN or Inf: contiguous float32 ones in
    one compiled pass (:func:`paramserver.native.all_finite`), the others by
    :func:`_sums_finite`."""
    return native.all_finite(tensors, _sums_finite)


def _sums_finite(tensors: list[Tensor]) -> bool:
    """Whether ``tensors`` hold no NaN or Inf, summed as a few tensors (:func:`_joined`), since
    a finite sum proves every element finite (NaN and Inf propagate; a sum that overflows is a
    false alarm, which the caller's closer look clears)."""
    return all(math.isfinite(float(joined.sum())) for joined in _joined(tensors))


def _joined(tensors: list[Tensor]) -> list[Tensor]:
    """A few tensors holding every value of ``tensors``: those that arrived as one bundle
    (views filling one storage, :func:`~paramserver.wire.bundles.joined_already`) as that bundle,
    not copied again; the others joined, one tensor per dtype."""
    groups: dict[tuple[torch.dtype, int], list[Tensor]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage().data_ptr()
        groups.setdefault((tensor.dtype, storage), []).append(tensor)
    whole: list[Tensor] = []
    loose: dict[torch.dtype, list[Tensor]] = {}
    for (dtype, _), parts in groups.items():
        bundle = joined_already(parts) if len(parts) > 1 else None  # else: one cat for all
        if bundle is not None:
            whole.append(bundle)
        else:
            loose.setdefault(dtype, []).extend(part.reshape(-1) for part in parts)
    return whole + [torch.cat(parts) for parts in loose.values()]
