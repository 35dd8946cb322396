"""The trainers' group, for ``--dense-sync allreduce``: an all-reduce among the trainers only.

:class:`CollectiveGroup` is a ``torch.distributed`` process group of the trainers (gloo for CPU
tensors, NCCL for CUDA ones where torch has it), met through a store: a file in the
local launcher's private directory, or torchrun's own store (``MASTER_ADDR:MASTER_PORT``, under
a prefix of its own). Local jobs bind gloo to ``lo`` (``GLOO_SOCKET_IFNAME``, set by the
launcher). :class:`ThreadGroup` is the same for trainers that are threads of one process.

A collective cannot go on without a member: a trainer that dies or freezes makes the others'
all-reduce fail after ``timeout_s`` at the latest (a dead peer usually at once: its connection
closes), with :class:`~paramserver.errors.TrainerGroupError`.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from paramserver.errors import TrainerGroupError

BUCKET_BYTES = 25 * 2**20
"""Gradients are reduced in buckets of about this size (DDP's default), each its own call."""


class Reduction(Protocol):
    def wait(self) -> None:
        """Block until the reduced values are in the tensors (raises TrainerGroupError)."""


class TrainerGroup(Protocol):
    size: int

    def all_reduce_sum(self, tensors: Sequence[Tensor]) -> Reduction:
        """Start replacing each tensor (in place) by its sum over the trainers."""

    def broadcast_from_chief(self, tensors: Sequence[Tensor]) -> None:
        """Replace each tensor (in place) by trainer 0's."""

    def close(self) -> None: ...


def buckets(tensors: Sequence[Tensor], limit: int = BUCKET_BYTES) -> list[list[Tensor]]:
    """``tensors`` in order, grouped into runs of at most ``limit`` bytes (a larger tensor is
    a run of its own) and of one dtype and device."""
    runs: list[list[Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        last = runs[-1][-1] if runs else None
        same = last is not None and (last.dtype, last.device) == (tensor.dtype, tensor.device)
        if not same or size + nbytes > limit:
            runs.append([])
            size = 0
        runs[-1].append(tensor)
        size += nbytes
    return runs


class _Pending:
    """Flat buckets under way; on wait, their sums go back into the tensors."""

    def __init__(self, parts: list[tuple[list[Tensor], Tensor, dist.Work]]):
        self.parts = parts

    def wait(self) -> None:
        for tensors, flat, work in self.parts:
            try:
                work.wait()
            except RuntimeError as error:
                raise TrainerGroupError(
                    f"the trainers' all-reduce failed: a trainer left the group (died, froze "
                    f"past the group's timeout, or failed): {error}"
                ) from None
            _unflatten(flat, tensors)
        self.parts = []


def _unflatten(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors``."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset : offset + count].view_as(tensor))
        offset += count


class CollectiveGroup:
    """The trainers as a ``torch.distributed`` process group (this process's default one)."""

    def __init__(self, rank: int, size: int, store: dist.Store, timeout_s: float):
        self.size = size
        # NCCL for CUDA tensors where this torch has it, gloo for CPU ones.
        backend = "cpu:gloo,cuda:nccl" if dist.is_nccl_available() else "gloo"
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @classmethod
    def through_file(cls, path: str, rank: int, size: int, timeout_s: float) -> CollectiveGroup:
        """Met through a file (the local launcher's private directory): no TCP rendezvous."""
        return cls(rank, size, dist.FileStore(path, size), timeout_s)

    @classmethod
    def through_torchrun(cls, rank: int, size: int, timeout_s: float) -> CollectiveGroup:
        """Met through torchrun's store, under a prefix of the trainers' own."""
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return cls(rank, size, dist.PrefixStore("paramserver/trainers/", store), timeout_s)

    def all_reduce_sum(self, tensors: Sequence[Tensor]) -> Reduction:
        parts = []
        for run in buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in run])
            try:
                work = dist.all_reduce(flat, async_op=True)
            except RuntimeError as error:
                raise TrainerGroupError(f"the trainers' all-reduce failed: {error}") from None
            parts.append((run, flat, work))
        return _Pending(parts)

    def broadcast_from_chief(self, tensors: Sequence[Tensor]) -> None:
        for run in buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in run])
            try:
                dist.broadcast(flat, src=0)
            except RuntimeError as error:
                raise TrainerGroupError(f"the trainers' broadcast failed: {error}") from None
            _unflatten(flat, run)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class ThreadGroup:
    """Trainers that are threads of one process (the threads launcher): each ``all_reduce``
    call of every member meets at a barrier; the sum is taken in rank order, so every member
    gets bitwise the same values."""

    def __init__(self, size: int, timeout_s: float):
        self.size = size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(size)
        self._lock = threading.Lock()
        self._offered: dict[int, list[Tensor]] = {}
        self._aborted = False

    def member(self, rank: int) -> TrainerGroup:
        return _ThreadMember(self, rank)

    def reduce(self, rank: int, tensors: Sequence[Tensor], chief_only: bool = False) -> None:
        """Every member's ``tensors`` become their sum (or, ``chief_only``, trainer 0's)."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        with self._lock:
            self._offered[rank] = [flat]
        self._meet()
        if chief_only:
            result = self._offered[0][0].clone()
        else:
            result = torch.zeros_like(flat)
            for member in range(self.size):
                result += self._offered[member][0]
        self._meet()  # everyone has read every offer before the next call replaces them
        _unflatten(result, tensors)

    def _meet(self) -> None:
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            why = (
                "another trainer failed"
                if self._aborted
                else f"a trainer did not join it within {self.timeout_s} s (it failed, left or "
                "is stuck)"
            )
            raise TrainerGroupError(f"the trainers' all-reduce failed: {why}") from None

    def abort(self) -> None:
        """Fail every member's all-reduce now (a member failed and will not come)."""
        self._aborted = True
        self._barrier.abort()


class _ThreadMember:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group = group
        self.rank = rank
        self.size = group.size

    def all_reduce_sum(self, tensors: Sequence[Tensor]) -> Reduction:
        self.group.reduce(self.rank, tensors)  # at once: threads have nothing to overlap with
        return _Done()

    def broadcast_from_chief(self, tensors: Sequence[Tensor]) -> None:
        self.group.reduce(self.rank, tensors, chief_only=True)

    def close(self) -> None:
        pass


class _Done:
    def wait(self) -> None:
        pass
