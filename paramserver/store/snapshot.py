"""A shard's state for checkpoints, and taking it back onto any number of servers.

A snapshot holds every value with its optimizer state, keyed so that it does not depend on the
shard layout: dense parameters by name, table rows by global row id (fixed tables) or id
(dynamic tables, with their pending ids and counters). Each table is copied under its own lock,
so every row is saved together with its own optimizer state even while training goes on; in
sync mode the chief takes the snapshots between two rounds, so all shards hold the same step.

Restoring onto server ``s`` of ``S'`` reads every saved shard and keeps what the new plan
gives ``s``: a checkpoint saved with ``S`` servers resumes on any ``S'``, unless a dynamic
table's ``capacity`` (rows per server) cannot hold the rows that server then gets, as on fewer
servers than were saved. That restore is refused rather than evicting restored rows at the first
read, and rather than scaling ``capacity``, which the model sets as its memory bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from paramserver.checkpoint.resume import Saved
from paramserver.errors import CheckpointError
from paramserver.server.dynamic import DynamicTable
from paramserver.server.shard import ServerShard


def model_signature(shard: ServerShard) -> dict[str, Any]:
    """What a checkpoint must match to be restored: the model's parameters and tables."""
    return shard.plan.signature


def snapshot_shard(shard: ServerShard) -> Saved:
    """Copies of this shard's values, optimizer state and bookkeeping (see the module doc)."""
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {
        "server": shard.server,
        "num_servers": shard.plan.num_servers,
        "clock": shard.clock,
        "dense": sorted(shard.dense),
        "tables": {},
        "aliases": shard.plan.aliases,  # for export: a shared weight under every name
    }
    for name, slot in shard.dense.items():
        with slot.lock:
            tensors[f"dense/{name}/value"] = slot.value.clone()
            tensors.update({f"dense/{name}/state.{k}": v.clone() for k, v in slot.state.items()})
            tensors[f"dense/{name}/step"] = slot.version.clone()
    for name, table in shard.tables.items():
        with table.lock:
            entries, table_meta = table.snapshot()
        tensors.update({f"table/{name}/{k}": v for k, v in entries.items()})
        meta["tables"][name] = {"dynamic": isinstance(table, DynamicTable), **table_meta}
    return tensors, meta


def restore_shard(shard: ServerShard, saved: Iterable[Saved]) -> None:
    """Load this server's part of every saved shard into ``shard`` (freshly built, not yet
    serving). Raises :class:`CheckpointError` if a saved shard does not fit the model, or if
    a dynamic table's rows on this server would exceed its ``capacity``."""
    saved_servers = None
    for tensors, meta in saved:
        try:
            _restore_one(shard, tensors, meta)
        except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"saved shard of server {meta.get('server')!r} does not fit this model: "
                f"{type(error).__name__}: {error}"
            ) from error
        saved_servers = meta.get("num_servers")
    _check_capacity(shard, saved_servers)


def _check_capacity(shard: ServerShard, saved_servers: Any) -> None:
    """Refuse a restore that gives a dynamic table more rows on this server than its capacity:
    its first read would evict them, silently."""
    for name, table in shard.tables.items():
        if not isinstance(table, DynamicTable) or table.options.capacity is None:
            continue
        rows, capacity = table.ids.num_rows, table.options.capacity
        if rows > capacity:
            raise CheckpointError(
                f"table {name!r}: restored onto {shard.plan.num_servers} server(s), server "
                f"{shard.server} would hold {rows} rows, over the table's capacity of "
                f"{capacity} rows per server (the checkpoint was saved by {saved_servers} "
                f"servers); resume on as many servers as it was saved by, or raise the "
                f"DynamicEmbedding's capacity to at least {rows}"
            )


def _restore_one(shard: ServerShard, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    plan = shard.plan
    for name in meta["dense"]:
        slot = shard.dense.get(name)
        if slot is None:
            continue  # another server's under the new plan
        slot.value.copy_(tensors[f"dense/{name}/value"])
        for key, value in slot.state.items():
            value.copy_(tensors[f"dense/{name}/state.{key}"])
        slot.version.copy_(tensors[f"dense/{name}/step"])
    if meta["server"] is None:  # the trainers' dense part (--dense-sync allreduce): no more
        return
    # Counters are per server: each new server takes those of the old servers it replaces.
    takes_counters = meta["server"] % plan.num_servers == shard.server
    for name, table_meta in meta["tables"].items():
        table = shard.tables[name]
        prefix = f"table/{name}/"
        entries = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        mine = plan.server_of_rows(name, entries["ids"]) == shard.server
        rows = {k: v[mine] for k, v in entries.items() if not k.startswith("pending.")}
        if isinstance(table, DynamicTable):
            pending_mine = plan.server_of_rows(name, entries["pending.ids"]) == shard.server
            rows.update(
                {k: v[pending_mine] for k, v in entries.items() if k.startswith("pending.")}
            )
            if not takes_counters:
                table_meta = {
                    **table_meta,
                    "counters": dict.fromkeys(table_meta["counters"], 0),
                }
        table.restore(rows, table_meta)
    shard.clock = max(shard.clock, int(meta["clock"]))
