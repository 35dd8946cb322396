"""A server's checks of the row ids a request names (:class:`IdChecks`): plain int64 ids,
within their table, routed to this server, sorted and unique; every set of a request looked
at together where it can be. :func:`reject` is the refusal every check of a request raises
(server/requests.py)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from paramserver import native
from paramserver.errors import InvalidPushError
from paramserver.sharding import ShardPlan
from paramserver.store.table import TableShard
from paramserver.wire.messages import PushPullRequest


def reject(server: int, param: str | None, reason: str) -> InvalidPushError:
    """The refusal of a request to server ``server`` for ``reason``, naming ``param``."""
    return InvalidPushError(reason, param=param, server=server)


class IdChecks:
    """The checks of the row ids a request names, against server ``server``'s ``tables``:
    plain int64 ids, within the table, routed to this server, sorted and unique; thread-safe."""

    def __init__(self, server: int, plan: ShardPlan, tables: Mapping[str, TableShard]):
        self.server = server
        self.plan = plan
        self.tables = tables

    def table(self, name: str) -> TableShard:
        """The table ``name``, or the refusal of a request naming one this server lacks."""
        table = self.tables.get(name)
        if table is None:
            raise reject(self.server, name, self.not_here(name))
        return table

    def not_here(self, name: str) -> str:
        """Why this server holds no parameter ``name``."""
        if name in self.plan.dense_server:
            return f"unknown here: dense parameter lives on server {self.plan.dense_server[name]}"
        if name in self.plan.dense:
            return "unknown here: the trainers keep dense parameters (--dense-sync allreduce)"
        if name in self.plan.buffers:
            return "a buffer: set by the chief trainer's pushes, never by gradients"
        return "unknown parameter or table name"

    def all_valid(self, request: PushPullRequest) -> bool:
        """Whether every set of ids ``request`` pushes or pulls rows of is valid (what
        :meth:`check` checks of sorted unique ids), looked at together
        (:func:`ascending_within`; not a few calls per table: a request names dozens). False
        also where anything about them is malformed: then each is checked on its own, in
        order, and the first refused is named."""
        blocks = request.row_grads.values()
        sets = [*(getattr(block, "ids", None) for block in blocks), *request.pull_rows.values()]
        names = [*request.row_grads, *request.pull_rows]
        tables = [self.tables.get(name) for name in names]
        arrays, bounds = [], []
        for ids, table in zip(sets, tables, strict=True):
            if table is None or not plain_ids(ids):
                return False
            assert isinstance(ids, Tensor)
            arrays.append(ids.numpy())
            bounds.append(table.id_bounds)
        if not ascending_within(arrays, bounds):
            return False
        if self.plan.num_servers == 1:
            return True
        return all(
            not bool((self.plan.server_of_rows(name, ids) != self.server).any())
            for name, ids in zip(names, sets, strict=True)
            if isinstance(ids, Tensor) and ids.numel()
        )

    def check(self, name: str, table: TableShard, ids: object, *, sorted_unique: bool) -> None:
        """Refuse ``ids`` of table ``name`` unless they are plain, in its range and on this
        server (and, with ``sorted_unique``, sorted and unique)."""
        if not plain_ids(ids):
            raise reject(self.server, name, "row ids must be a 1-D int64 CPU tensor")
        assert isinstance(ids, Tensor)
        if ids.numel() == 0:
            return
        values = ids.numpy()  # numpy: a few hundred ids cost less there than in torch
        ordered = values.size < 2 or bool((values[1:] > values[:-1]).all())
        # The ends of sorted ids are their extremes.
        ends = (values[0], values[-1]) if ordered else (values.min(), values.max())
        (low, high), least, greatest = table.id_bounds, int(ends[0]), int(ends[1])
        if least < low or greatest > high:
            bad = least if least < low else greatest
            raise reject(self.server, name, f"row id {bad} out of range [{low}, {high + 1})")
        if self.plan.num_servers > 1 and bool(
            (self.plan.server_of_rows(name, ids) != self.server).any()
        ):
            raise reject(self.server, name, "row ids routed to the wrong server")
        if sorted_unique and not ordered:
            raise reject(self.server, name, "row ids must be sorted and unique")


def plain_ids(ids: object) -> bool:
    """Whether ``ids`` are row ids as a request must carry them: a 1-D int64 CPU tensor."""
    return (
        isinstance(ids, Tensor)
        and ids.dtype == torch.int64
        and ids.dim() == 1
        and ids.layout == torch.strided
        and ids.is_cpu
    )


def ascending_within(arrays: list[np.ndarray], bounds: list[tuple[int, int]]) -> bool:
    """Whether each of ``arrays`` (int64 ids) rises strictly and lies within its ``bounds``
    (low, high: both included): in one compiled call (:func:`paramserver.native.ascending_within`),
    else by :func:`ascending_within_joined`."""
    return native.ascending_within(arrays, bounds, ascending_within_joined)


def ascending_within_joined(arrays: list[np.ndarray], bounds: list[tuple[int, int]]) -> bool:
    """:func:`ascending_within` by numpy: the arrays joined and compared in a few array
    operations (not a few per array: a request has dozens)."""
    sizes = np.array([array.size for array in arrays], dtype=np.int64)
    ends = np.cumsum(sizes)
    values = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    rising = values[1:] > values[:-1]
    between = ends[:-1] - 1  # where one array meets the next: no order between them
    rising[between[(between >= 0) & (between < rising.size)]] = True
    filled = sizes > 0
    lows, highs = np.array(bounds, dtype=np.int64).reshape(-1, 2)[filled].T
    firsts, lasts = values[(ends - sizes)[filled]], values[ends[filled] - 1]
    return bool(rising.all() and (firsts >= lows).all() and (lasts <= highs).all())
