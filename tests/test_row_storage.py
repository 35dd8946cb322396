"""A table's row storage: a dynamic table's memory per row within its bound, a capacity that
is not a reservation, storage of a huge page or more mapped with huge pages, and a dynamic
table's storage grown in place (tests/test_dynamic.py: the tables' behaviour)."""

from __future__ import annotations

import mmap
import subprocess
import sys
from typing import Any

import pytest
import torch

from paramserver import native
from paramserver.embedding import DynamicOptions
from paramserver.optim import make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.sharding import TableSpec
from paramserver.store import growth
from paramserver.store.dynamic import DynamicTable
from paramserver.store.growth import (
    GROWTH_ROOM_BYTES,
    HUGE_PAGE_BYTES,
    RESERVE_GROWTH,
    regrown,
    row_storage,
)
from paramserver.store.table import Reading


@pytest.mark.parametrize(
    ("optimizer", "slot_bytes"),
    [("sgd", 0), ("adagrad", 64), ("rowwise_adagrad", 4), ("adam", 128)],
)
@pytest.mark.parametrize("evicts", [False, True])
def test_memory_per_row_stays_within_the_bound(
    optimizer: str, slot_bytes: int, evicts: bool
) -> None:
    """Rows plus optimizer state plus bookkeeping within 1.25 x (row + state bytes), the id map
    within 32 bytes per row, at every fill level."""
    options: dict[str, object] = {"ttl_steps": 10**6} if evicts else {}
    spec = TableSpec("t", 0, 16, torch.float32, dynamic=DynamicOptions(**options))  # type: ignore[arg-type]
    t = DynamicTable(spec, make_rule(OptimizerConfig(name=optimizer, lr=0.1)))
    g = torch.Generator().manual_seed(0)
    bound = 1.25 * (16 * 4 + slot_bytes)
    for step in range(1, 60):
        t.read(
            torch.randint(-(2**62), 2**62, (1500,), generator=g), Reading(train=True, clock=step)
        )
        rows = t.stats()["rows"]
        id_map = t.ids.nbytes() + t.pending.nbytes()
        assert (t.nbytes() - id_map) / rows <= bound
        assert t.ids.nbytes() / rows <= 32


def test_a_capacity_is_a_bound_not_a_reservation() -> None:
    """A 500-row table with a 50M-row capacity holds storage for its rows, not 50M (which
    would be 50M x (128 + 128) bytes with Adagrad's state): within the per-row bound of the
    test above; and its storage never grows past the capacity (plus the rows one step creates
    before eviction makes room) when rows keep coming."""
    capacity = 50_000_000
    spec = TableSpec(
        "t", 0, 32, torch.float32, dynamic=DynamicOptions(capacity=capacity, ttl_steps=10**6)
    )
    t = DynamicTable(spec, make_rule(OptimizerConfig(name="adagrad", lr=0.1)))
    t.read(torch.arange(500, dtype=torch.int64) * 7919, Reading(train=True, clock=1))
    assert t.stats()["rows"] == 500
    id_map = t.ids.nbytes() + t.pending.nbytes()
    assert (t.nbytes() - id_map) / 500 <= 1.25 * (32 * 4 * 2)
    assert t.nbytes() < 1_000_000  # was about 13 GB reserved up front
    small = DynamicTable(
        TableSpec("s", 0, 4, torch.float32, dynamic=DynamicOptions(capacity=100, ttl_steps=10**6)),
        make_rule(OptimizerConfig(name="sgd", lr=0.1)),
    )
    for step in range(1, 6):
        small.read(torch.arange(60, dtype=torch.int64) + 60 * step, Reading(train=True, clock=step))
        # Rows are created before eviction makes room: one step's 60 may come on top.
        assert small.weight.shape[0] <= 100 + 60
        assert small.stats()["rows"] <= 100


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address`` (Linux's smaps)."""
    holds = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: its range
                start, end = (int(bound, 16) for bound in head.split("-"))
                holds = start <= address < end
            elif head == "VmFlags:" and holds:
                return line.split()[1:]
    return []


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="Linux's huge pages")
def test_storage_allocated_whole_asks_for_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed table's storage of a huge page or more is mapped on its own with huge pages
    advised (VmFlags ``hg``); smaller tensors are plain ones, mapped by no one here (the
    allocator's heap they land in may carry any flags)."""
    mappings: list[int] = []
    mapped = growth._mapped

    def counted(nbytes: int, **kwargs: bool) -> mmap.mmap:
        mappings.append(nbytes)
        return mapped(nbytes, **kwargs)

    monkeypatch.setattr(growth, "_mapped", counted)
    rows = HUGE_PAGE_BYTES // (32 * 4) + 100
    big = row_storage((rows, 32), torch.float32)
    assert big.shape == (rows, 32) and "hg" in vm_flags(big.data_ptr())
    assert mappings == [rows * 32 * 4]
    big.copy_(torch.arange(rows * 32, dtype=torch.float32).view(rows, 32))
    assert float(big[-1, -1]) == rows * 32 - 1
    small = row_storage((100, 32), torch.float32)
    assert small.shape == (100, 32) and mappings == [rows * 32 * 4]


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def test_a_dynamic_tables_storage_grows_in_place_keeping_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A growth copies a tensor into storage with room for GROWTH_ROOM_BYTES (at least
    RESERVE_GROWTH times the rows, at most the bound asked for; RESERVE_GROWTH times where
    the room cannot be left unreserved), which costs no memory until rows reach it, and does
    not stop the process from forking; growths within that room keep it where it is, rows
    and state kept. Where the system refuses that much, the room is RESERVE_GROWTH times the
    rows, else none."""
    plain = torch.arange(300 * 4, dtype=torch.float32).view(300, 4)
    before = resident_bytes()
    grown = [regrown(plain, 307) for _ in range(4)][-1]  # copied, with room to grow in place
    assert resident_bytes() - before < 64 << 20  # the room is address space, not memory
    room = GROWTH_ROOM_BYTES if native.MAP_NORESERVE else 0
    assert grown.untyped_storage().nbytes() >= max(room, 307 * RESERVE_GROWTH * 16)
    # A fork charged for the room would fail (ENOMEM): preexec_fn makes Popen fork, not vfork.
    subprocess.run([sys.executable, "-c", "pass"], check=True, preexec_fn=lambda: None)
    assert torch.equal(grown[:300], plain) and grown.shape == (307, 4)
    grown[300:] = -1.0
    again = regrown(grown, 307 * RESERVE_GROWTH)
    assert again.data_ptr() == grown.data_ptr() and torch.equal(again[:307], grown)
    bounded = regrown(plain, 307, most=1000)
    assert bounded.untyped_storage().nbytes() == 1000 * 16 and torch.equal(bounded[:300], plain)
    mapped = growth._mapped

    def refused_beyond(limit: int) -> Any:
        def mapping(nbytes: int, *, reserved: bool = True) -> mmap.mmap:
            if nbytes > limit:
                raise OSError("Cannot allocate memory")
            return mapped(nbytes, reserved=reserved)

        return mapping

    monkeypatch.setattr(growth, "_mapped", refused_beyond(307 * RESERVE_GROWTH * 16))
    assert regrown(plain, 307).untyped_storage().nbytes() == 307 * RESERVE_GROWTH * 16
    monkeypatch.setattr(growth, "_mapped", refused_beyond(0))
    alone = regrown(plain, 307)
    assert alone.untyped_storage().nbytes() == 307 * 16 and torch.equal(alone[:300], plain)
    monkeypatch.undo()
    spec = TableSpec("t", 0, 32, torch.float32, dynamic=DynamicOptions())
    t = DynamicTable(spec, make_rule(OptimizerConfig(name="adagrad", lr=0.1)))
    ids = torch.arange(4000, dtype=torch.int64) * 7919
    first = t.read(ids[:1000], Reading(train=True, clock=1))
    t.apply(ids[:1000], torch.ones(1000, 32), 1, lr=0.1)
    updated, state = t.read(ids[:1000], Reading()), t.state["sum"][:1000].clone()
    address = t.weight.data_ptr(), t.state["sum"].data_ptr()
    t.read(ids, Reading(train=True, clock=2))  # 4x the rows: within the room
    assert (t.weight.data_ptr(), t.state["sum"].data_ptr()) == address
    assert not torch.equal(updated, first) and torch.equal(t.read(ids[:1000], Reading()), updated)
    assert torch.equal(t.state["sum"][:1000], state)
