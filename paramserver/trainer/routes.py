"""How a table's ids split over the servers, for a call's pull and the push of their rows'
gradients (:class:`Route`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from paramserver.sharding import ShardPlan
from paramserver.wire.idcodec import PackedIds, PackedTables, compact_all, pack_tables


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
        return cls(ids, order, counts, ids[order].split(counts))

    @cached_property
    def packed(self) -> tuple[Tensor | PackedIds, ...]:
        """Each server's ids compacted for the wire (:func:`compact_ids`), for a push of the
        gradients of rows routed anew (a call's pull packs every table's ids together, and
        its rows' gradients go with those: :func:`packed_by_server`). Only for sorted unique
        ids."""
        return tuple(compact_all(self.parts))

    def split(self, values: Tensor) -> tuple[Tensor, ...]:
        """``values`` (aligned with ``ids``) as every server's part, in server order."""
        if self.order is None:
            return (values,)
        return values[self.order].split(self.counts)

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


def packed_by_server(routes: Mapping[str, Route], num_servers: int) -> list[PackedTables]:
    """Each server's part of every table's ids, packed together (:func:`pack_tables`: one
    compiled call a server, however many tables)."""
    names = list(routes)
    return [
        pack_tables(names, [route.parts[server] for route in routes.values()])
        for server in range(num_servers)
    ]
