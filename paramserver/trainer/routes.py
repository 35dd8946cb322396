"""How a table's ids split over the servers, for a call's pull and the push of their rows'
gradients (:class:`Route`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from paramserver.sharding import ShardPlan
from paramserver.wire.compression import Encoded
from paramserver.wire.idcodec import PackedIds, PackedTables, compact_all, pack_tables
from paramserver.wire.messages import RowBlocks

Encode = Callable[[str, Tensor], Tensor | Encoded]


@dataclass(frozen=True)
class Route:
    """How one table's ids split over the servers: ``ids[order]`` lists server 0's first, then
    server 1's, and so on, ``counts[s]`` of server ``s`` (see ShardPlan.split_by_server;
    ``order`` None: one server, the ids' own order); ``parts`` holds each server's ids, the
    same tensors in the pull and in the push of their gradients (neither changes them once
    sent), and ``packed`` the same as they travel."""

    ids: Tensor
    order: Tensor | None
    counts: list[int]
    parts: tuple[Tensor, ...]

    @classmethod
    def of(cls, plan: ShardPlan, table: str, ids: Tensor) -> Route:
        if plan.num_servers == 1:  # nothing to split: spare the ops (they add up per table)
            return cls(ids, None, [ids.numel()], (ids,))
        order, counts = plan.split_by_server(table, ids)
        return cls(ids, order, counts, ids[order].split_with_sizes(counts))

    @cached_property
    def packed(self) -> tuple[Tensor | PackedIds, ...]:
        """Each server's ids compacted for the wire (:func:`compact_ids`), for a push of the
        gradients of rows routed anew (a call's pull packs every table's ids together, and
        its rows' gradients go with those: :class:`CallRoutes`). Only for sorted unique
        ids."""
        return tuple(compact_all(self.parts))

    def split(self, values: Tensor) -> tuple[Tensor, ...]:
        """``values`` (aligned with ``ids``) as every server's part, in server order."""
        if self.order is None:
            return (values,)
        return values[self.order].split_with_sizes(self.counts)

    def by_server(self, *aligned: Tensor) -> list[tuple[int, list[Tensor]]]:
        """Each server's non-empty part of the ids and of the tensors aligned with them, as
        ``(server, [ids, *aligned])``."""
        split = [self.parts, *(self.split(t) for t in aligned)]
        return [(s, [t[s] for t in split]) for s, count in enumerate(self.counts) if count]

    def in_caller_order(self, parts: list[Tensor]) -> Tensor:
        """Every server's answer for its part (in server order) as one tensor aligned with
        ``ids``."""
        if self.order is None:
            return parts[0]
        aligned = torch.empty((self.ids.numel(), *parts[0].shape[1:]), dtype=parts[0].dtype)
        aligned[self.order] = torch.cat(parts)
        return aligned


@dataclass(frozen=True)
class CallRoutes:
    """A call's pull as it went: each table's :class:`Route`, and every server's part of
    their ids packed together (``packed``: one compiled call a server, however many tables;
    every server gets its part of each table, empty or not). The gradients of those rows go
    with the same ids (:meth:`grads_by_server`)."""

    routes: dict[str, Route]
    packed: list[PackedTables]

    @classmethod
    def of(cls, plan: ShardPlan, pull_ids: Mapping[str, Tensor]) -> CallRoutes:
        routes = {name: Route.of(plan, name, ids) for name, ids in pull_ids.items()}
        if not routes:
            return cls(routes, [])
        names, servers = list(routes), range(plan.num_servers)
        packed = [pack_tables(names, [r.parts[s] for r in routes.values()]) for s in servers]
        return cls(routes, packed)

    def grads_by_server(
        self, row_grads: Mapping[str, tuple[Tensor, Tensor]], encode: Encode
    ) -> list[RowBlocks] | None:
        """Each server's part of ``row_grads`` (per table: ids and their gradients) with the
        ids as this pull sent them, its values encoded by ``encode(table, values)`` (an
        empty part as it is); None unless they are the gradients of every row it routed (its
        very ids tensors)."""
        routes = self.routes
        if not self.packed or row_grads.keys() != routes.keys():
            return None
        if not all(routes[name].ids is ids for name, (ids, _) in row_grads.items()):
            return None
        parts = {name: routes[name].split(row_grads[name][1]) for name in routes}
        return [
            RowBlocks(
                packed,
                {n: encode(n, p[s]) if p[s].numel() else p[s] for n, p in parts.items()},
            )
            for s, packed in enumerate(self.packed)
        ]
