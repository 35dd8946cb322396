"""Where each parameter lives.

Dense parameters: each lives whole on one server. They are placed largest first, each on the
server holding the fewest bytes so far (ties go to the lower server index, names break ties
between equal sizes), which balances bytes across servers to within the largest parameter.

Buffers (persistent ones: batch-norm statistics and the like) are placed as dense values are,
after them, each on the server holding the fewest bytes so far. A server keeps a buffer as a
value with no optimizer state: the chief trainer's pushes set it, gradients never update it.

Fixed embedding tables: every table is split by row across all servers, cyclically. Global
row ``r`` lives on server ``r % num_servers`` at local index ``r // num_servers``. Cyclic (not
contiguous) ranges matter for recommendation data: ids are Zipf-distributed and the hot ids are
often the small ones, so contiguous ranges would put most of the traffic on server 0.

Dynamic tables (any int64 id): an id hashes to one of ``NUM_BUCKETS`` buckets, and bucket ``b``
belongs to server ``b * num_servers // NUM_BUCKETS`` (contiguous bucket ranges). The bucket of
an id never changes, so a table saved from S servers can be restored onto any other number by
reassigning whole buckets.

The plan is a pure function of the model's structure and ``num_servers``; trainers and servers
compute it independently and compare :attr:`ShardPlan.fingerprint` at start-up.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from paramserver.embedding import DynamicOptions
from paramserver.hashing import mix64

NUM_BUCKETS = 1 << 12
_BUCKET_SALT = 0x5DEECE66D  # routing must not share bits with a server's own id-map hash


@dataclass(frozen=True)
class DenseSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class TableSpec:
    name: str
    num_rows: int  # 0 for a dynamic table
    dim: int
    dtype: torch.dtype
    dynamic: DynamicOptions | None = None


class ShardPlan:
    """Placement of dense parameters and routing of table rows over ``num_servers`` servers."""

    def __init__(
        self,
        dense: list[DenseSpec],
        tables: list[TableSpec],
        num_servers: int,
        dense_on_servers: bool = True,
        aliases: Mapping[str, str] | None = None,
        buffers: Sequence[DenseSpec] = (),
    ):
        """``dense_on_servers`` False: the trainers keep the dense parameters
        (``--dense-sync allreduce``), and none is placed on a server. ``aliases``: the other
        state_dict names of tables' weights (shared by several layers), each with its table;
        checkpoints record them for ``paramserver export``. ``buffers``: the model's persistent
        buffers, always on the servers (the chief trainer's are the model's)."""
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.num_servers = num_servers
        self.dense = {spec.name: spec for spec in dense}
        self.tables = {spec.name: spec for spec in tables}
        self.dense_on_servers = dense_on_servers
        self.aliases = dict(aliases or {})
        self.buffers = {spec.name: spec for spec in buffers}
        load = [0] * num_servers
        self.dense_server = self._place_dense(dense, load) if dense_on_servers else {}
        self.buffer_server = self._place_dense(buffers, load)

    @staticmethod
    def _place_dense(dense: Sequence[DenseSpec], load: list[int]) -> dict[str, int]:
        """Each of ``dense`` on the server of least ``load`` (bytes placed, updated here)."""
        num_servers = len(load)
        placement: dict[str, int] = {}
        for spec in sorted(dense, key=lambda s: (-s.nbytes, s.name)):
            server = min(range(num_servers), key=lambda s: (load[s], s))
            placement[spec.name] = server
            load[server] += spec.nbytes
        return placement

    @property
    def fixed(self) -> frozenset[str]:
        """The tables of rows ``0..num_rows-1`` (not dynamic)."""
        return frozenset(name for name, spec in self.tables.items() if spec.dynamic is None)

    def dense_on(self, server: int) -> list[str]:
        return [name for name, s in self.dense_server.items() if s == server]

    def buffers_on(self, server: int) -> list[str]:
        return [name for name, s in self.buffer_server.items() if s == server]

    def server_of_rows(self, table: str, ids: Tensor) -> Tensor:
        if self.num_servers == 1:
            return torch.zeros_like(ids)
        if self.tables[table].dynamic is not None:
            buckets = mix64(ids ^ _BUCKET_SALT) & (NUM_BUCKETS - 1)
            return buckets * self.num_servers // NUM_BUCKETS
        return torch.remainder(ids, self.num_servers)

    def local_rows(self, ids: Tensor) -> Tensor:
        """Local index of fixed-table rows on their server."""
        return torch.div(ids, self.num_servers, rounding_mode="floor")

    def split_by_server(self, table: str, ids: Tensor) -> tuple[Tensor, list[int]]:
        """A stable permutation that groups ``ids`` by server, and the group sizes.

        ``ids[order]`` lists server 0's ids first, then server 1's, and so on, each group keeping
        the order it had in ``ids``.
        """
        servers = self.server_of_rows(table, ids)
        order = torch.argsort(servers, stable=True)
        counts = torch.bincount(servers, minlength=self.num_servers).tolist()
        return order, counts

    @property
    def signature(self) -> dict[str, Any]:
        """What a checkpoint's part must match to be restored: the model's parameters and
        tables (not their placement)."""
        return {
            "dense": {n: [list(s.shape), str(s.dtype)] for n, s in sorted(self.dense.items())},
            "tables": {
                n: [t.num_rows, t.dim, str(t.dtype), t.dynamic is not None]
                for n, t in sorted(self.tables.items())
            },
        }

    @property
    def fingerprint(self) -> str:
        described = {
            "num_servers": self.num_servers,
            "dense_on_servers": self.dense_on_servers,
            "dense": [[n, list(s.shape), str(s.dtype)] for n, s in sorted(self.dense.items())],
            "tables": [
                [n, s.num_rows, s.dim, str(s.dtype), repr(s.dynamic)]
                for n, s in sorted(self.tables.items())
            ],
        }
        if self.buffers:  # a model without buffers keeps the fingerprint it always had
            described["buffers"] = [
                [n, list(s.shape), str(s.dtype)] for n, s in sorted(self.buffers.items())
            ]
        return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def merge_rows(parts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One table's rows from every server, in id order: each part maps ``"ids"`` (global row
    ids, or a dynamic table's ids) and per-row tensors (values, state) to that server's rows.
    For a fixed table the result is its rows 0..N-1 in order."""
    order = torch.argsort(torch.cat([part["ids"] for part in parts]))
    return {key: torch.cat([part[key] for part in parts])[order] for key in parts[0]}
