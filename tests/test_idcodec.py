"""Row ids packed for the wire: every set of sorted unique int64 ids comes back exactly, in the
narrowest step type; a peer's malformed packing is named, never raised on; servers check and
unpack packed ids before anything else of a request, within the size cap; and a job's bytes per
step come within 1.05x of the least its rows, dense parameters and id sets need."""

from __future__ import annotations

import itertools
import math
import pickle
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver import native
from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.wire.idcodec import (
    STEP_DTYPES,
    PackedIds,
    PackedTables,
    TablesProblem,
    compact_all,
    compact_ids,
    min_id_nbytes,
    num_ids,
    pack_tables,
    packed_problem,
    unpack_all,
    unpack_ids,
    unpack_tables,
)
from paramserver.wire.messages import PushPullRequest, RowBlock, RowBlocks
from paramserver.wire.sizing import clone_message, message_sizes
from tests.helpers import MakeServer, counted, own_ids

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def random_id_sets(rng: random.Random) -> Iterator[tuple[str, list[int]]]:
    """(kind, sorted unique ids) covering the shapes id sets take, and their edges."""
    yield "empty", []
    yield "int64 min and max", [INT64_MIN, INT64_MAX]
    yield "one int64 max", [INT64_MAX]
    yield "one int64 min", [INT64_MIN]
    for _ in range(40):
        n = rng.choice([1, 2, 3, 50, 1000])
        start = rng.choice([0, rng.randrange(2**20), INT64_MAX - 2 * n, INT64_MIN, -(2**40)])
        yield "dense range", list(range(start, start + n))
        universe = rng.choice([300, 70_000, 10**9, 2**40, 2**62])
        yield "sparse range", sorted(rng.sample(range(universe), min(n, universe)))
        near_top = INT64_MAX - rng.choice([10**4, 2**31, 2**40])
        yield "huge ids near 2^63", sorted(rng.sample(range(near_top, INT64_MAX + 1), n))
        yield "anywhere in int64", sorted({rng.randint(INT64_MIN, INT64_MAX) for _ in range(n)})
        yield "one id", [rng.randint(INT64_MIN, INT64_MAX)]
        # Steps just at and past each type's edge: 255/256, 32767/32768, 2^31 - 1 / 2^31.
        edge = rng.choice([255, 256, 2**15 - 1, 2**15, 2**31 - 1, 2**31])
        yield "a step at a type's edge", [7, 7 + edge, 7 + edge + 1]


def narrowest(steps: list[int]) -> torch.dtype | None:
    largest = max(steps, default=0)
    return next((t for t in STEP_DTYPES if largest <= torch.iinfo(t).max), None)


def test_every_id_set_round_trips_in_the_narrowest_step_type() -> None:
    rng = random.Random(14)
    kinds: dict[str, int] = {}
    for kind, id_list in random_id_sets(rng):
        ids = torch.tensor(id_list, dtype=torch.int64)
        original = ids.clone()
        sent = compact_ids(ids)
        received = pickle.loads(pickle.dumps(clone_message(sent)))  # as a wire would carry it
        steps = [b - a for a, b in itertools.pairwise(id_list)]
        expected = narrowest(steps)
        if expected is None:  # no step type holds them: the int64 ids themselves travel
            assert type(received) is Tensor and torch.equal(received, ids), kind
            continue
        assert type(received) is PackedIds, kind
        assert packed_problem(received) is None, kind
        assert received.steps.dtype == expected, (kind, id_list[:4])
        assert received.nbytes == 8 + len(id_list) * expected.itemsize
        unpacked = unpack_ids(received)
        assert unpacked.dtype == torch.int64 and torch.equal(unpacked, ids), kind
        assert num_ids(received) == len(id_list)
        assert torch.equal(ids, original)  # the sender's ids are left as they were
        kinds[kind] = kinds.get(kind, 0) + 1
    assert set(kinds) >= {"empty", "one id", "dense range", "sparse range", "huge ids near 2^63"}


@pytest.mark.parametrize("loops", ["compiled", "numpy"])
def test_all_of_a_requests_id_sets_pack_together_as_each_alone(
    loops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compact_all over several sets (a request's tables and servers) gives what compact_ids
    gives each: the same type, first id, step dtype and steps, or the same int64 ids; by the
    compiled loop and by numpy, with steps at each type's bounds among the sets."""
    calls = [0]
    if loops == "numpy":
        monkeypatch.setattr(native, "loops", None)
    elif native.loops is None:
        pytest.skip("the compiled loops are not built")
    else:
        calls = counted(monkeypatch, "pack_steps")
    rng = random.Random(30)
    sets = [torch.tensor(ids, dtype=torch.int64) for _, ids in random_id_sets(rng)]
    for bound in (255, 256, 2**15 - 1, 2**15, 2**31 - 1, 2**31):
        sets.append(torch.tensor([5, 5 + bound, 7 + bound]))
    for _ in range(60):
        parts = rng.sample(sets, rng.randint(1, 6))
        for alone, together in zip(map(compact_ids, parts), compact_all(parts), strict=True):
            assert type(alone) is type(together)
            if type(alone) is PackedIds and type(together) is PackedIds:
                assert alone.first == together.first
                assert alone.steps.dtype == together.steps.dtype
                assert torch.equal(alone.steps, together.steps)
            else:
                assert together is not None and torch.equal(alone, together)  # type: ignore[arg-type]
    assert calls[0] == (60 if loops == "compiled" else 0)
    if loops == "compiled":  # a peer of the wrong shape is refused, nothing written past out
        out = np.zeros(8, np.uint8)
        with pytest.raises(ValueError, match="not int64"):
            native.loops.pack_steps([np.arange(3, dtype=np.int32)], out)
        with pytest.raises(ValueError, match="too short"):
            native.loops.pack_steps([np.arange(0, 3000, 300)], out)


def test_a_dense_range_costs_a_byte_an_id_and_an_int64_spread_travels_as_ids() -> None:
    dense = compact_ids(torch.arange(1000) + (INT64_MAX - 999))
    assert type(dense) is PackedIds and dense.steps.dtype == torch.uint8
    assert dense.nbytes == 8 + 1000
    spread = torch.tensor([INT64_MIN, 0, INT64_MAX])
    assert compact_ids(spread) is spread


def test_min_id_nbytes_is_log2_of_the_number_of_sets() -> None:
    assert min_id_nbytes(0, 100) == 0.0
    assert min_id_nbytes(100, 100) == 0.0
    assert min_id_nbytes(1, 256) == pytest.approx(1.0)  # 256 choices: 8 bits
    assert min_id_nbytes(3, 50) == pytest.approx(math.log2(math.comb(50, 3)) / 8)
    with pytest.raises(ValueError, match="distinct ids"):
        min_id_nbytes(5, 4)


def malformed() -> list[tuple[str, object, str]]:
    """(what is wrong, a peer's object, the reason named)."""
    good = PackedIds(10, torch.tensor([0, 3, 4], dtype=torch.int16))

    def with_steps(steps: Any, first: Any = 10) -> PackedIds:
        return PackedIds(first, steps)

    class Subclass(PackedIds):
        pass

    return [
        ("a tensor", torch.arange(3), "expected PackedIds"),
        ("a dict", {"first": 0, "steps": torch.zeros(1)}, "expected PackedIds"),
        ("a subclass", Subclass(0, good.steps), "expected PackedIds"),
        ("no fields", object.__new__(PackedIds), "first id"),
        ("float first", with_steps(good.steps, 1.0), "first id"),
        ("bool first", with_steps(good.steps, True), "first id"),
        ("tensor first", with_steps(good.steps, torch.tensor(1)), "first id"),
        ("first past int64", with_steps(good.steps, 2**63), "first id"),
        ("first below int64", with_steps(good.steps, -(2**63) - 1), "first id"),
        ("list steps", with_steps([0, 1]), "1-D dense CPU tensor"),
        ("2-D steps", with_steps(torch.zeros(2, 2, dtype=torch.uint8)), "1-D dense CPU tensor"),
        ("sparse steps", with_steps(torch.ones(3, dtype=torch.int16).to_sparse()), "1-D dense"),
        ("meta steps", with_steps(torch.ones(3, dtype=torch.int16, device="meta")), "1-D dense"),
        ("int64 steps", with_steps(torch.tensor([0, 1])), "uint8, int16 or int32"),
        ("int8 steps", with_steps(torch.tensor([0, 1], dtype=torch.int8)), "uint8, int16"),
        ("float steps", with_steps(torch.tensor([0.0, 1.0])), "uint8, int16 or int32"),
        ("negative step", with_steps(torch.tensor([0, 5, -2], dtype=torch.int16)), "negative"),
        ("negative first step", with_steps(torch.tensor([-1, 1], dtype=torch.int32)), "negative"),
        ("repeated id", with_steps(torch.tensor([0, 1, 0], dtype=torch.uint8)), "unique"),
        (
            "ids past int64",
            with_steps(
                torch.tensor([0, 2**31 - 1, 2**31 - 1, 2], dtype=torch.int32), 2**63 - 2**32
            ),
            "past int64",
        ),
    ]


@pytest.mark.parametrize(("what", "packed", "reason"), malformed(), ids=[m[0] for m in malformed()])
def test_a_malformed_packing_is_named_not_raised(what: str, packed: object, reason: str) -> None:
    problem = packed_problem(packed)
    assert problem is not None and reason in problem, (what, problem)


def test_the_edges_of_int64_are_accepted() -> None:
    top = PackedIds(
        INT64_MAX - 2**32 + 2, torch.tensor([0, 2**31 - 1, 2**31 - 1], dtype=torch.int32)
    )
    assert packed_problem(top) is None
    assert int(unpack_ids(top)[-1]) == INT64_MAX
    bottom = PackedIds(INT64_MIN, torch.tensor([0, 1], dtype=torch.uint8))
    assert unpack_ids(bottom).tolist() == [INT64_MIN, INT64_MIN + 1]


def test_a_requests_sets_unpack_together_as_each_alone_and_the_first_malformed_is_named(
    loop_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """unpack_all over several peers' sets gives what unpack_ids gives each, and where any is
    malformed, the place of the first that packed_problem refuses: by the compiled loop (one
    call, however many sets) and by torch."""
    calls = counted(monkeypatch, "unpack_steps") if loop_mode == "compiled" else [0]
    rng = random.Random(31)
    good: list[PackedIds] = []
    for _, ids in random_id_sets(rng):
        packed = compact_ids(torch.tensor(ids, dtype=torch.int64))
        if type(packed) is PackedIds:
            good.append(packed)
    wide = compact_ids(torch.arange(0, 600, 3))  # its steps as a strided view below
    assert type(wide) is PackedIds
    good.append(PackedIds(wide.first, torch.stack([wide.steps, wide.steps], 1)[:, 0]))
    good.append(PackedIds(INT64_MAX - 3, torch.tensor([1, 1, 1], dtype=torch.uint8)))
    assert not good[-2].steps.is_contiguous()
    bad = [packed for _, packed, _ in malformed()]
    for round_ in range(40):
        sets: list[object] = rng.sample(good, rng.randint(1, 8))
        unpacked, malformed_at = unpack_all(sets)
        assert malformed_at == -1
        assert len(unpacked) == len(sets)
        for ids, packed in zip(unpacked, sets, strict=True):
            assert ids.dtype == torch.int64 and torch.equal(ids, unpack_ids(packed))  # type: ignore[arg-type]
        spoiled = rng.sample(bad, rng.randint(1, 2))
        for wrong in spoiled:
            sets.insert(rng.randint(0, len(sets)), wrong)
        first = next(j for j, packed in enumerate(sets) if packed_problem(packed) is not None)
        assert unpack_all(sets)[1] == first, round_
    assert calls[0] > 40 if loop_mode == "compiled" else calls[0] == 0


def test_tables_packed_together_unpack_to_their_ids_and_pack_as_each_alone(loop_mode: str) -> None:
    """pack_tables lays every table's ids out as compact_ids packs each (the same first id,
    step type and steps, or the int64 ids where no step type holds them), and unpack_tables
    gives them back: by the compiled loop and by numpy."""
    rng = random.Random(32)
    sets = [torch.tensor(ids, dtype=torch.int64) for _, ids in random_id_sets(rng)]
    for round_ in range(60):
        parts = rng.sample(sets, rng.randint(0, 7))
        names = [f"t{j}" for j in range(len(parts))]
        packed = pack_tables(names, parts)
        assert packed.names == tuple(names) and packed.sizes.dtype == torch.int32
        heads = zip(packed.firsts.tolist(), packed.sizes.tolist(), strict=True)
        for (first, size), part in zip(heads, parts, strict=True):
            alone, code = compact_ids(part), size & 3
            assert size >> 2 == part.numel()
            if type(alone) is PackedIds:
                assert (first, STEP_DTYPES[code]) == (alone.first, alone.steps.dtype), round_
            else:
                assert code == len(STEP_DTYPES)  # no step type holds them: the ids travel
        wire = pickle.loads(pickle.dumps(clone_message(packed)))
        unpacked = unpack_tables(wire)
        assert type(unpacked) is dict and list(unpacked) == names
        for ids, part in zip(unpacked.values(), parts, strict=True):
            assert ids.dtype == torch.int64 and torch.equal(ids, part), round_


def spoiled_tables() -> list[tuple[str, object, str | None, str]]:
    """(what, a peer's packed tables, the table named or None, the reason named)."""
    good = pack_tables(["a", "b"], [torch.tensor([3, 9, 10]), torch.arange(100, 90_000, 300)])
    names, firsts, sizes, data = good.names, good.firsts, good.sizes, good.data

    def with_size(table: int, change: int) -> PackedTables:
        spoiled = sizes.clone()
        spoiled[table] += change
        return PackedTables(names, firsts, spoiled, data)

    def with_step(table: int, at: int, step: int, first: int | None = None) -> PackedTables:
        spoiled_firsts, spoiled = firsts.clone(), data.clone()
        start, code = (0, 0) if table == 0 else (8, 1)  # a: uint8 steps, b: int16 from byte 8
        dtype = STEP_DTYPES[code]
        assert int(sizes[table]) & 3 == code
        spoiled[start:].view(dtype)[at] = step  # type: ignore[index]
        if first is not None:
            spoiled_firsts[table] = first
        return PackedTables(names, spoiled_firsts, sizes, spoiled)

    laid_out, kinds = "lay its tables out", "must be int64 and int32"
    return [
        ("not packed tables", {"a": torch.arange(3)}, None, "expected PackedTables"),
        ("names not a tuple", PackedTables(["a", "b"], firsts, sizes, data), None, "names"),  # type: ignore[arg-type]
        ("a name twice", PackedTables(("a", "a"), firsts, sizes, data), None, "twice"),
        ("firsts of floats", PackedTables(names, firsts.double(), sizes, data), None, kinds),
        ("sizes of int64", PackedTables(names, firsts, sizes.long(), data), None, kinds),
        ("a first missing", PackedTables(names, firsts[:1], sizes, data), None, kinds),
        ("a size missing", PackedTables(names, firsts, sizes[:1], data), None, kinds),
        ("sizes of 2-D", PackedTables(names, firsts, sizes.view(1, 2), data), None, kinds),
        ("data of int16", PackedTables(names, firsts, sizes, data.view(torch.int16)), None, "data"),
        ("data a list", PackedTables(names, firsts, sizes, list(data)), None, "data"),  # type: ignore[arg-type]
        ("data strided", PackedTables(names, firsts, sizes, data.repeat(2)[::2]), None, "data"),
        ("sizes strided", PackedTables(names, firsts, sizes.repeat(2)[::2], data), None, kinds),
        ("a negative count", with_size(0, -16), None, "counts"),
        ("a count past the data", with_size(1, 4 * 10**8), None, "counts"),
        ("one id more", with_size(1, 4), None, laid_out),
        ("one id fewer", with_size(1, -4), None, laid_out),
        ("a wider code", with_size(1, 1), None, laid_out),
        ("ids, not steps", with_size(1, 2), None, laid_out),
        (
            "data left over",
            PackedTables(names, firsts, sizes, torch.cat([data, data[:8]])),
            None,
            laid_out,
        ),
        ("data cut short", PackedTables(names, firsts, sizes, data[:-1]), None, laid_out),
        ("a repeated id", with_step(0, 1, 0), "a", "unique"),
        ("a negative step", with_step(1, 2, -2), "b", "negative"),
        ("ids past int64", with_step(0, 2, 200, first=INT64_MAX - 100), "a", "past int64"),
    ]


def test_every_spoiled_packing_of_tables_is_named_not_unpacked(loop_mode: str) -> None:
    for what, packed, table, reason in spoiled_tables():
        found = unpack_tables(packed)
        assert type(found) is TablesProblem, what
        assert found.table == table and reason in found.reason, (what, found)


# ---- a server takes packed ids like any other field ----


def test_a_server_applies_and_answers_packed_ids_as_it_does_plain_ones(
    make_server: MakeServer,
) -> None:
    """Plain ids, ids packed a table at a time, and every table's packed together (as a
    trainer sends them): the same answers, the same state."""
    endpoints = [make_server(servers=2) for _ in range(3)]
    ids, items = own_ids(endpoints[0], 0, 3, 19), own_ids(endpoints[0], 0, 3, 14)
    grads = torch.arange(12.0).view(3, 4)

    def request_of(kind: str, **fields: Any) -> PushPullRequest:
        pulled = {"items.weight": items}
        if kind == "together":
            return PushPullRequest(
                0,
                0,
                packed_grads=RowBlocks(
                    pack_tables(["user.weight", "items.weight"], [ids, items[:0]]),
                    {"user.weight": grads, "items.weight": torch.zeros(0, 4)},
                ),
                packed_pulls=pack_tables(list(pulled), list(pulled.values())),
                **fields,
            )
        pack = compact_ids if kind == "each" else (lambda t: t)
        return PushPullRequest(
            0,
            0,
            row_grads={"user.weight": RowBlock(pack(ids), grads)},
            pull_rows={name: pack(t) for name, t in pulled.items()},
            **fields,
        )

    assert request_of("together").has_grads
    empty = RowBlocks(pack_tables(["user.weight"], [ids[:0]]), {"user.weight": grads[:0]})
    assert not PushPullRequest(0, 0, packed_grads=empty).has_grads  # no table has rows
    answers = []
    for endpoint, kind in zip(endpoints, ["plain", "each", "together"], strict=True):
        answers.append(endpoint.handle("push_pull", (request_of(kind),)).wait())
        again = endpoint.handle("push_pull", (request_of(kind),)).wait()  # a repeat: reads only
        assert torch.equal(again.rows["items.weight"], answers[-1].rows["items.weight"])
        read = request_of(kind, pull_dense=False)
        read.drop_gradients()
        assert endpoint.handle("pull", (read,)).wait().rows["items.weight"].shape == (3, 4)
    for answer in answers[1:]:
        assert torch.equal(answers[0].rows["items.weight"], answer.rows["items.weight"])
    hashes = {endpoint.shard.store.state_hash() for endpoint in endpoints}
    assert len(hashes) == 1
    assert endpoints[0].shard.stats.pushes == 1


def test_a_malformed_packing_of_tables_is_refused_whole_and_changes_nothing(
    make_server: MakeServer,
) -> None:
    endpoint = make_server()
    before = endpoint.shard.store.state_hash()
    mine = own_ids(endpoint, 0, 1)
    good = pack_tables(["user.weight"], [mine])
    grads = {"user.weight": torch.ones(2, 4)}
    cases: list[tuple[str, PushPullRequest, type[Exception], str]] = []
    for what, packed, table, reason in spoiled_tables():
        expected = InvalidPushError if table is not None else ParamServerError
        if type(packed) is not PackedTables:  # refused with the request's header
            reason = "packed ids of another kind"
        for field in ("packed_pulls", "packed_grads"):
            value: Any = packed
            if field == "packed_grads" and type(packed) is PackedTables:
                names = packed.names if type(packed.names) is tuple else ("a", "b")
                value = RowBlocks(packed, {name: torch.ones(0, 4) for name in set(names)})
            cases.append((what, PushPullRequest(0, 0, **{field: value}), expected, reason))
    both = PushPullRequest(0, 0, packed_pulls=good, pull_rows={"user.weight": mine})
    cases.append(("a table sent both ways", both, InvalidPushError, "packed together and alone"))
    other = RowBlocks(good, {"items.weight": torch.ones(2, 4)})
    cases.append(
        (
            "values of another table",
            PushPullRequest(0, 0, packed_grads=other),
            ParamServerError,
            "other tables",
        )
    )
    junk = PushPullRequest(0, 0, packed_grads=good)  # type: ignore[arg-type]
    cases.append(("packed ids of another kind", junk, ParamServerError, "another kind"))
    wrong = RowBlocks(pack_tables(["user.weight"], [mine + 1]), grads)  # another server's rows
    cases.append(
        (
            "another server's rows",
            PushPullRequest(0, 0, packed_grads=wrong),
            InvalidPushError,
            "wrong server",
        )
    )
    for what, request, expected, reason in cases:
        with pytest.raises(expected) as caught:
            endpoint.handle("push_pull", (request,)).wait()
        assert reason in str(caught.value), (what, caught.value)
    assert endpoint.shard.store.state_hash() == before
    assert endpoint.coordinator.last_call == {}  # no call was taken


def test_tables_packed_together_are_refused_before_they_unpack_past_the_cap(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(servers=1, trainers=1, max_message_mb=1 / 4096)  # 256 bytes
    many = pack_tables(["items.weight"], [torch.arange(40)])  # 40 bytes, 320 once unpacked
    request = PushPullRequest(0, 0, pull_dense=False, packed_pulls=many)
    with pytest.raises(InvalidPushError, match="may unpack past the cap of 256 bytes"):
        endpoint.handle("pull", (request,)).wait()
    assert request.packed_pulls is many and request.pull_rows == {}  # refused, not unpacked


def spoiled_packings(endpoint: Any) -> list[tuple[str, PackedIds, str]]:
    """(what, packed ids for 2 rows of user.weight, reason): each fatal to a request."""
    mine = own_ids(endpoint, 0, 1)
    good = compact_ids(mine)
    assert type(good) is PackedIds
    first, steps = good.first, good.steps

    def packed(steps: Tensor, first: int = first) -> PackedIds:
        return PackedIds(first, steps)

    return [
        ("negative step", packed(torch.tensor([0, -2], dtype=torch.int16)), "negative step"),
        ("repeat", packed(torch.tensor([0, 0], dtype=torch.uint8)), "unique"),
        ("int64 steps", packed(steps.long()), "uint8, int16 or int32"),
        ("float steps", packed(steps.float()), "uint8, int16 or int32"),
        ("overflow", packed(steps.int(), INT64_MAX - 1), "past int64"),
        ("more ids than values", packed(torch.cat([steps, steps[1:]])), "shape"),
        ("fewer ids than values", packed(steps[:1]), "shape"),
        ("another server's rows", packed(steps, first + 1), "wrong server"),
        ("past the table", packed(steps, 10**6), "out of range"),
        ("negative ids", packed(steps, -(2**40)), "out of range"),
    ]


@pytest.mark.parametrize("where", ["row_grads", "pull_rows"])
def test_a_malformed_packing_is_refused_whole_and_changes_nothing(
    make_server: MakeServer, where: str
) -> None:
    endpoint = make_server()
    before = endpoint.shard.store.state_hash()
    for what, bad, reason in spoiled_packings(endpoint):
        grads = torch.ones(2, 4)
        if where == "row_grads":
            request = PushPullRequest(0, 0, row_grads={"user.weight": RowBlock(bad, grads)})
        elif reason == "shape":  # a pull has no values to disagree with
            continue
        else:
            request = PushPullRequest(0, 0, pull_rows={"user.weight": bad})
        with pytest.raises(InvalidPushError, match=reason) as caught:
            endpoint.handle("push_pull", (request,)).wait()
        assert "'user.weight'" in str(caught.value) and "server 0" in str(caught.value), what
    assert endpoint.shard.store.state_hash() == before
    assert endpoint.coordinator.last_call == {}  # no call was taken


def test_of_a_requests_malformed_packings_the_first_is_named(make_server: MakeServer) -> None:
    """Row gradients' ids are unpacked before the pulls', each field in its order: a request
    with several malformed packings is refused naming the first of them."""
    endpoint = make_server()
    good = compact_ids(own_ids(endpoint, 0, 1))
    assert type(good) is PackedIds
    repeat = PackedIds(good.first, torch.tensor([0, 0], dtype=torch.uint8))
    negative = PackedIds(good.first, torch.tensor([0, -2], dtype=torch.int16))
    grads = torch.ones(2, 4)
    cases = [
        ({"user.weight": RowBlock(good, grads)}, {"items.weight": repeat}, "'items.weight'"),
        ({"user.weight": RowBlock(negative, grads)}, {"items.weight": repeat}, "'user.weight'"),
        ({}, {"items.weight": good, "user.weight": negative}, "'user.weight'"),
    ]
    for row_grads, pulls, named in cases:
        request = PushPullRequest(0, 0, row_grads=row_grads, pull_rows=pulls)
        with pytest.raises(InvalidPushError, match="malformed packed ids") as caught:
            endpoint.handle("push_pull", (request,)).wait()
        assert named in str(caught.value)
    assert endpoint.coordinator.last_call == {}


def test_packed_ids_count_unpacked_against_the_cap_before_they_are_unpacked(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(servers=1, trainers=1, max_message_mb=1 / 4096)  # 256 bytes
    before = endpoint.shard.store.state_hash()
    # 40 ids: 48 bytes on the wire, 320 once unpacked (and 640 of rows the pull would read).
    many = compact_ids(torch.arange(40))
    assert type(many) is PackedIds and many.nbytes == 48
    assert message_sizes(many) == (48 + 320, 48)
    request = PushPullRequest(0, 0, pull_dense=False, pull_rows={"items.weight": many})
    with pytest.raises(InvalidPushError, match=r"'items.weight'.*holding \d+ bytes.*exceeds"):
        endpoint.handle("pull", (request,)).wait()
    assert request.pull_rows["items.weight"] is many  # refused before it was unpacked

    # 10 ids read 160 bytes of rows (under the cap); 20 would read 320.
    def pull_of(count: int) -> PushPullRequest:
        ids = compact_ids(torch.arange(count))
        return PushPullRequest(0, 0, pull_dense=False, pull_rows={"items.weight": ids})

    assert endpoint.handle("pull", (pull_of(10),)).wait().rows["items.weight"].shape == (10, 4)
    with pytest.raises(InvalidPushError, match="answer reading 320 bytes"):
        endpoint.handle("push_pull", (pull_of(20),)).wait()
    assert endpoint.shard.store.state_hash() == before


# ---- a job's bytes per step ----

ROWS, DIM, BATCH, STEPS = 20_000, 16, 256, 12


class OneTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.emb(ids)).squeeze(1)


def uniform_batches(trainer: int, trainers: int) -> Iterator[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(trainer)
    for _ in range(STEPS):
        yield torch.randint(0, ROWS, (BATCH,), generator=g), torch.rand(BATCH, generator=g)


def test_a_jobs_bytes_per_step_come_within_1_05x_of_the_least_it_needs() -> None:
    servers, trainers = 2, 2
    config = ps.TrainConfig(
        servers=servers, trainers=trainers, optimizer="sgd", lr=0.05, launcher="threads",
        progress=False,
    )  # fmt: skip
    mse = nn.functional.mse_loss
    summary = ps.train(OneTable, uniform_batches, mse, config).summary
    # What a step needs: its distinct rows, the dense parameters, and (pushed) the two id sets
    # naming its rows per server, their gradients' and the next pull's, at log2 C(N, k) bits.
    dense = (DIM + 1) * 4
    rows = ids_bound = 0.0
    for trainer in range(trainers):
        for ids, _ in uniform_batches(trainer, trainers):
            unique = ids.unique()
            rows += unique.numel() * DIM * 4
            for server in range(servers):
                owned = int((unique % servers == server).sum())
                ids_bound += 2 * min_id_nbytes(owned, ROWS // servers)
    steps = trainers * STEPS
    assert summary["steps"] == steps
    least_push = (rows + ids_bound) / steps + dense
    least_pull = rows / steps + dense
    push, pull = summary["bytes_per_step"]["push"], summary["bytes_per_step"]["pull"]
    assert least_push <= push <= 1.05 * least_push, (push, least_push)
    assert least_pull <= pull <= 1.05 * least_pull, (pull, least_pull)
    assert summary["compression_ratio"] == {"push": 1.0, "pull": 1.0}  # ids are not a codec
