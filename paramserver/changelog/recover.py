"""A training server's store rebuilt from its last checkpoint and its change log since.

A publisher that records for recovery (``Publisher(recovers=True)``) cuts, with each segment,
a recovery section (:class:`~paramserver.changelog.segment.Recovery`): for every row changed
or touched since the last cut, the row whole as a snapshot has it (value, optimizer state,
step count, version, last touch), a dynamic table's pending ids counted or forgotten with
their counters, every dynamic table's counters, the changed dense values with their state,
and the store's clock (:func:`~paramserver.changelog.collect.recovery_of`); a full segment's
holds the whole store. A server's durable state is then its last
checkpoint part plus the segments after it: :func:`recover_store` restores the one and
replays the others in order (:func:`replay`), which sets each row, pending id and counter to
what it was at the segment's cut, so the store ends where the original was at the last cut,
bitwise, whatever it did since the checkpoint (admissions, expiries, evictions included).

Why the state and not the calls: replaying what the server applied since the checkpoint would
take about as long as applying it did, minutes on a job that checkpoints every few minutes,
while setting the rows a segment lists costs one copy of each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from paramserver.changelog.segment import Segment
from paramserver.errors import ChangeLogError
from paramserver.store.snapshot import Saved, restore_store
from paramserver.store.store import Store


def replay(store: Store, segment: Segment) -> None:
    """Bring ``store`` to where its server was at ``segment``'s cut (the segments before it
    replayed, or a checkpoint restored that covers their changes): its removed ids deleted,
    its rows, pending ids and counters set, its dense values set, its clock advanced."""
    recovery = segment.recovery
    if recovery is None:
        raise ChangeLogError(
            f"segment {segment.sequence} of server {segment.server} holds no recovery section "
            f"(its job published for serving only)"
        )
    for name, changes in segment.tables.items():
        if changes.removed.numel():
            store.delete_ids(name, changes.removed)
    for name, entries in recovery.tables.items():
        store.replay(name, entries, recovery.meta[name])
    for name, entries in recovery.dense.items():
        slot = store.dense[name]
        state = {slot_name: entries[f"state.{slot_name}"] for slot_name in slot.state}
        store.set_dense(name, entries["value"], state, entries["version"])
    store.advance_clock(recovery.clock)


def recover_store(store: Store, saved: Iterable[Saved], segments: Sequence[Segment]) -> None:
    """Rebuild ``store`` (its server's, fresh): restored from its checkpoint part ``saved``,
    then each of ``segments`` (its chain from the one that holds the checkpoint's change on,
    in order) replayed; from the newest full segment among them, where there is one (it
    holds the whole store: the checkpoint is not read)."""
    full = [i for i, segment in enumerate(segments) if segment.full]
    if full:
        segments = segments[full[-1] :]
    else:
        restore_store(store, saved)
    for segment in segments:
        replay(store, segment)
    if segments:  # its changes number on from the last segment's: the chain continues
        store.changes.restored(segments[-1].changes, resharded=False)
