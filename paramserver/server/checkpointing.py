"""A server's side of checkpoints: announce, snapshot, write in the background, and (server 0)
collect the trainers' parts for the chief.

The chief announces a checkpoint step ``k`` (``plan``); every answer a server gives from then
on carries it, so each trainer learns it before it reaches ``k``. At step ``k`` each trainer
writes its own part and reports it (``add_trainer_part``, to server 0), and the chief asks every
server to ``take`` its snapshot: the copy is made at once, under each parameter's lock, and
written to disk by a background thread, so training goes on. The chief then waits (in its own
thread) for ``part`` from every server and ``trainer_parts`` from server 0, and commits.

A server whose changes are published keeps its change log back to the newest committed
checkpoint (``on_committed`` is told that checkpoint's store change, learnt at each snapshot):
serving, or a recovery, starts from that checkpoint and replays the log from there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Set
from contextlib import AbstractContextManager
from typing import Any

from torch.futures import Future

from paramserver.checkpoint import Part, checkpoint_dir, write_part
from paramserver.checkpoint.store import committed_steps
from paramserver.futures import completed
from paramserver.server.shard import ServerShard
from paramserver.store.snapshot import model_signature, snapshot_store

log = logging.getLogger(__name__)


class ServerCheckpoints:
    def __init__(self, shard: ServerShard, members: Callable[[], Set[int]], root: str | None):
        """``members``: the trainers still in the job (those whose parts a checkpoint needs);
        ``root``: the job's ``--checkpoint-dir`` (None: checkpoints are off)."""
        self.shard = shard
        self.root = root
        self.members = members
        self.planned = -1  # the newest step announced
        self.taken_through = -1  # the newest step snapshotted
        self._writes: dict[int, Future] = {}  # step -> Future[Part]
        self._trainer_parts: dict[int, dict[int, Part]] = {}
        self._waiting: dict[int, list[Future]] = {}
        self._changes_at: dict[int, int] = {}  # step -> the store change its snapshot covers
        self.on_committed: Callable[[int], None] | None = None
        # A recovering async server's: the snapshot is taken between calls, with the books
        # as they are then (which a server recovered from the checkpoint alone takes).
        self.between_calls: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        self.books: Callable[[], dict[str, Any]] | None = None
        self._lock = threading.Lock()

    def resume_at(self, step: int) -> None:
        """The job resumed from checkpoint ``step``: it counts as announced and taken."""
        with self._lock:
            self.planned = self.taken_through = step

    def pending_snapshot(self) -> int | None:
        """The announced step whose snapshot is not taken yet, if any."""
        with self._lock:
            return self.planned if self.planned > self.taken_through else None

    def plan(self, step: int) -> Future:
        with self._lock:
            self.planned = max(self.planned, step)
        return completed(None)

    def take(self, step: int) -> Future:
        """Snapshot now; write ``server-S`` into checkpoint ``step`` in the background."""
        if self.root is None or step < 0:
            raise ValueError(f"server {self.shard.server}: no checkpoint directory, or bad step")
        directory = checkpoint_dir(self.root, step)
        with self.between_calls():
            tensors, meta = snapshot_store(self.shard.store)
            if self.books is not None:
                meta["books"] = self.books()
        meta["step"] = step
        meta["signature"] = model_signature(self.shard.store)
        with self._lock:
            self._changes_at[step] = int(meta["sequence"])
        written: Future = Future()

        def write() -> None:
            self._tell_committed()  # here, not in the RPC thread: it reads the directory
            try:
                part = write_part(directory, f"server-{self.shard.server}", tensors, meta)
            except Exception as error:  # the chief hears of it when it asks for the part
                log.exception("server %d: writing checkpoint %d failed", self.shard.server, step)
                written.set_exception(error)
            else:
                written.set_result(part)

        with self._lock:
            self._writes[step] = written
            self.taken_through = max(self.taken_through, step)
            for old in [s for s in self._writes if s < step and self._writes[s].done()]:
                del self._writes[old]
        threading.Thread(target=write, name=f"checkpoint-{step}", daemon=True).start()
        return completed(None)

    def _tell_committed(self) -> None:
        """Tell ``on_committed`` the change of the newest committed checkpoint this server
        snapshotted."""
        if self.on_committed is None or self.root is None:
            return
        steps = committed_steps(self.root)
        with self._lock:
            known = [s for s in steps if s in self._changes_at]
            if not known:
                return
            changes = self._changes_at[known[-1]]
            self._changes_at = {s: c for s, c in self._changes_at.items() if s >= known[-1]}
        self.on_committed(changes)

    def part(self, step: int) -> Future:
        """This server's part of checkpoint ``step``, once written."""
        with self._lock:
            written = self._writes.get(step)
        if written is None:
            raise ValueError(f"server {self.shard.server} took no snapshot for step {step}")
        return written

    def add_trainer_part(self, step: int, trainer: int, part: Part) -> Future:
        with self._lock:
            self._trainer_parts.setdefault(step, {})[trainer] = part
        self.members_changed()
        return completed(None)

    def trainer_parts(self, step: int) -> Future:
        """The parts of every trainer still in the job for ``step``, once all have reported
        (a trainer that leaves meanwhile is not waited for)."""
        future: Future = Future()
        with self._lock:
            self._waiting.setdefault(step, []).append(future)
        self.members_changed()
        return future

    def members_changed(self) -> None:
        """Complete the waits that no longer lack a part (also after a trainer left)."""
        members = set(self.members())
        done = []
        with self._lock:
            for step in list(self._waiting):
                have = self._trainer_parts.get(step, {})
                if members <= have.keys():
                    parts = [have[t] for t in sorted(have)]
                    done += [(future, parts) for future in self._waiting.pop(step)]
                    self._trainer_parts = {s: p for s, p in self._trainer_parts.items() if s > step}
        for future, parts in done:
            future.set_result(parts)
