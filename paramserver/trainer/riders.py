"""What rides on a trainer's calls beside its rows: server-pooled tables' bags and their
gradients (:class:`PooledBags`), and the chief's buffers (:class:`ChiefBuffers`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from paramserver.sharding import ShardPlan
from paramserver.trainer.routes import Route
from paramserver.wire.compression import Encoded
from paramserver.wire.messages import BagBlock, PooledGrad, PushPullRequest


class PooledBags:
    """Server-pooled tables: each server gets its part of a call's bags to pool, and the
    gradient of the pooled sums goes back to the servers that pooled them."""

    def __init__(self, plan: ShardPlan):
        self.plan = plan
        self._servers: dict[tuple[int, str], list[int]] = {}  # who holds pulled bags, by call

    def add_bags(
        self, requests: list[PushPullRequest], pool_bags: Mapping[str, BagBlock]
    ) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
        """Each server's part of the bags to pool; returns the shape and dtype of each table's
        pooled sums."""
        pooled_shapes = {}
        for name, bags in pool_bags.items():
            spec = self.plan.tables[name]
            pooled_shapes[name] = ((bags.num_bags, spec.dim), spec.dtype)
            aligned = [bags.bags] + ([] if bags.weights is None else [bags.weights])
            servers = []
            route = Route.of(self.plan, name, bags.ids)
            for server, (part_ids, part_bags, *weights) in route.by_server(*aligned):
                requests[server].pool_rows[name] = BagBlock(
                    part_ids, part_bags, bags.num_bags, weights[0] if weights else None
                )
                servers.append(server)
            self._servers[(requests[0].call, name)] = servers
        return pooled_shapes

    def add_grads(
        self,
        requests: list[PushPullRequest],
        pooled_grads: Mapping[str, tuple[int, Tensor]],
        encode: Callable[[str, Tensor], Tensor | Encoded],
    ) -> None:
        """Each table's gradient of pooled sums (for the bags its call pulled), encoded by
        ``encode(table, grads)``, goes to the servers that pooled them."""
        for name, (pull_call, grads) in pooled_grads.items():
            encoded = encode(name, grads)
            for server in self._servers.pop((pull_call, name)):
                requests[server].pooled_grads[name] = PooledGrad(pull_call, encoded)


class ChiefBuffers:
    """The chief trainer's model's buffers the plan places on the servers: each call carries
    those that changed since the last one did, the final call all. Changed by value: a
    tensor's ``_version`` would be cheaper, but batch norm's kernel updates its running
    statistics without bumping it."""

    def __init__(self, plan: ShardPlan, buffers: Mapping[str, Tensor]):
        self.plan = plan
        self.buffers = {name: buffers[name] for name in plan.buffers}
        self.sent = {name: b.detach().clone() for name, b in self.buffers.items()}

    def add_changed(self, requests: list[PushPullRequest], final: bool) -> None:
        for name, buffer in self.buffers.items():
            if final or not torch.equal(buffer, self.sent[name]):
                value = buffer.detach().clone()
                self.sent[name] = value
                requests[self.plan.buffer_server[name]].buffers[name] = value
