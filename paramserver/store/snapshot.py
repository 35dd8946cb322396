"""A store's state for checkpoints, and taking it back onto any number of servers.

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

A snapshot records the store's change sequence (:mod:`paramserver.store.changes`) taken before
its copies: every change numbered up to it is in the snapshot (a later one may be too, in async
mode, where training goes on while tables are copied one by one). A restored store numbers its
changes on from the highest sequence saved (what the restore itself wrote is no change), and
says whether it was restored from its own part alone (``ChangeFeed.resharded``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from paramserver.errors import CheckpointError
from paramserver.store.store import Store

Saved = tuple[dict[str, Tensor], dict[str, Any]]  # one part: its tensors and its JSON metadata


def model_signature(store: Store) -> dict[str, Any]:
    """What a checkpoint must match to be restored: the model's parameters and tables."""
    return store.plan.signature


def snapshot_store(store: Store) -> Saved:
    """Copies of this store's values, optimizer state and bookkeeping (see the module doc)."""
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {
        "server": store.server,
        "num_servers": store.plan.num_servers,
        "clock": store.clock,
        "sequence": store.changes.covered(),
        "dense": sorted(store.dense),
        "tables": {},
        "aliases": store.plan.aliases,  # for export: a shared weight under every name
    }
    for name, slot in store.dense.items():
        with slot.lock:
            tensors[f"dense/{name}/value"] = slot.value.clone()
            tensors.update({f"dense/{name}/state.{k}": v.clone() for k, v in slot.state.items()})
            tensors[f"dense/{name}/step"] = slot.version.clone()
    for name, table in store.tables.items():
        with table.lock:
            entries, table_meta = table.snapshot()
        tensors.update({f"table/{name}/{k}": v for k, v in entries.items()})
        meta["tables"][name] = {"dynamic": table.spec.dynamic is not None, **table_meta}
    return tensors, meta


def restore_store(store: Store, saved: Iterable[Saved]) -> None:
    """Load this server's part of every saved shard into ``store`` (freshly built, not yet
    serving). Raises :class:`CheckpointError` if a saved shard does not fit the model, or if
    a dynamic table's rows on this server would exceed its ``capacity``."""
    saved_servers = None
    parts: list[tuple[Any, Any, int]] = []  # each part's server, server count and sequence
    for tensors, meta in saved:
        try:
            _restore_one(store, tensors, meta)
        except (KeyError, IndexError, RuntimeError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"saved shard of server {meta.get('server')!r} does not fit this model: "
                f"{type(error).__name__}: {error}"
            ) from error
        saved_servers = meta.get("num_servers")
        parts.append((meta["server"], saved_servers, int(meta.get("sequence", 0))))
    _check_capacity(store, saved_servers)
    own = [(store.server, store.plan.num_servers)]
    store.changes.restored(
        max((sequence for *_, sequence in parts), default=0),
        resharded=[part[:2] for part in parts] != own,
    )


def _check_capacity(store: Store, saved_servers: Any) -> None:
    """Refuse a restore that gives a dynamic table more rows on this server than its capacity:
    its first read would evict them, silently."""
    for name, table in store.tables.items():
        if table.spec.dynamic is None or table.spec.dynamic.capacity is None:
            continue
        rows, capacity = table.stats()["rows"], table.spec.dynamic.capacity
        if rows > capacity:
            raise CheckpointError(
                f"table {name!r}: restored onto {store.plan.num_servers} server(s), server "
                f"{store.server} would hold {rows} rows, over the table's capacity of "
                f"{capacity} rows per server (the checkpoint was saved by {saved_servers} "
                f"servers); resume on as many servers as it was saved by, or raise the "
                f"DynamicEmbedding's capacity to at least {rows}"
            )


def _restore_one(store: Store, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    plan = store.plan
    for name in meta["dense"]:
        if name not in store.dense:
            continue  # another server's under the new plan
        prefix = f"dense/{name}/state."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        store.set_dense(name, tensors[f"dense/{name}/value"], state, tensors[f"dense/{name}/step"])
    if meta["server"] is None:  # the trainers' dense part (--dense-sync allreduce): no more
        return
    # Counters are per server: each new server takes those of the old servers it replaces.
    takes_counters = meta["server"] % plan.num_servers == store.server
    for name, table_meta in meta["tables"].items():
        table = store.tables[name]
        prefix = f"table/{name}/"
        entries = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        mine = plan.server_of_rows(name, entries["ids"]) == store.server
        rows = {k: v[mine] for k, v in entries.items() if not k.startswith("pending.")}
        if table.spec.dynamic is not None:
            pending_mine = plan.server_of_rows(name, entries["pending.ids"]) == store.server
            rows.update(
                {k: v[pending_mine] for k, v in entries.items() if k.startswith("pending.")}
            )
            if not takes_counters:
                table_meta = {
                    **table_meta,
                    "counters": dict.fromkeys(table_meta["counters"], 0),
                }
        table.restore(rows, table_meta)
    store.clock = max(store.clock, int(meta["clock"]))
