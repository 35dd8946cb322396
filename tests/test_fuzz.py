"""Randomized malformed calls from a peer: each is refused with a typed error and changes
nothing; a call over the size cap is refused too. Row ids come plain or packed
(paramserver.wire.idcodec), and packed ids are spoiled as any other field."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.wire.compression import Encoded, encode
from paramserver.wire.idcodec import PackedIds, PackedTables, compact_ids, pack_tables
from paramserver.wire.messages import BagBlock, PooledGrad, PushPullRequest, RowBlock, RowBlocks
from paramserver.wire.reports import TrainerReport
from tests.helpers import MakeServer, a_dense_name, own_ids

GARBAGE: list[Any] = [
    None, 3, -1, 2**70, 1.5, float("nan"), "x", b"\x00", [], {}, (1,), object(),
    torch.ones(3), torch.ones(2, 2, dtype=torch.float64), torch.tensor([float("inf")]),
    torch.zeros(0), torch.ones(1, 4).to_sparse(), torch.ones(4, requires_grad=True),
]  # fmt: skip


def corruptions(endpoint: Any, rng: random.Random) -> list[Callable[[PushPullRequest], None]]:
    """Ways to spoil a valid request, each always fatal to it."""
    dense = a_dense_name(endpoint)
    shape = tuple(endpoint.shard.store.dense[dense].value.shape)
    junk = lambda: rng.choice(GARBAGE)  # noqa: E731
    # Never a field left out (None) or left empty ({}): junk that no field may hold.
    some_junk = lambda: rng.choice([g for g in GARBAGE if g is not None and type(g) is not dict])  # noqa: E731

    def bad_ids() -> torch.Tensor:
        return rng.choice(
            [
                torch.tensor([-1 - 2 * rng.randrange(100)]),  # negative, any server
                torch.tensor([10**9 + endpoint.shard.server]),  # out of range
                own_ids(endpoint, 2, 1),  # unsorted
                own_ids(endpoint, 1, 1),  # repeated
                own_ids(endpoint, 0) + 1,  # another server's
                own_ids(endpoint, 0).int(),  # not int64
            ]
        )

    def bad_packed(count: int = 2) -> PackedIds:
        """Packed ids that are wrong whatever the rest of the request (``count`` of them, if
        they unpack at all)."""
        good = compact_ids(own_ids(endpoint, *range(count)))
        assert type(good) is PackedIds
        first, steps = good.first, good.steps
        wrong_step = steps.to(torch.int16).clone()
        at = rng.randrange(count)  # a negative step anywhere, a step of 0 past the first
        wrong_step[at] = rng.choice([-1, -(2**15)] + ([0] if at else []))
        return rng.choice(
            [
                PackedIds(first, wrong_step),  # negative or repeated
                PackedIds(first, steps.to(rng.choice([torch.int64, torch.int8, torch.float32]))),
                PackedIds(2**63 - 1, steps.int()),  # past int64
                PackedIds(first + 1, steps),  # another server's rows
                PackedIds(first + 10**9, steps),  # out of range
                PackedIds(-1 - 2 * rng.randrange(100), steps),  # negative
                PackedIds(junk(), steps),
                PackedIds(first, junk()),
                PackedIds(first, steps.reshape(1, -1)),
            ]
        )

    def bad_tables(names: tuple[str, ...]) -> Any:
        """Tables' ids packed together that are wrong whatever the rest of the request."""
        ids = [own_ids(endpoint, 0, 1) for _ in names]
        good = pack_tables(names, ids)
        sizes, data = good.sizes.clone(), good.data.clone()
        sizes[rng.randrange(len(names))] += rng.choice([-8, 1, 2, 36, 2**29])
        return rng.choice(
            [
                some_junk(),
                PackedTables(names, good.firsts, sizes, good.data),  # laid out past its data
                PackedTables(names, good.firsts, good.sizes, data[: rng.randrange(data.numel())]),
                PackedTables((*names, "x"), good.firsts, good.sizes, good.data),
                PackedTables(names, good.firsts, good.sizes.long(), good.data),
                PackedTables(names, good.firsts, good.sizes, junk()),
                pack_tables(names, [own_ids(endpoint, 1, 1) for _ in names]),  # repeated ids
                pack_tables(names, [own_ids(endpoint, 0) + 1 for _ in names]),  # wrong server
            ]
        )

    def spoiled_grad() -> Any:
        bad = torch.ones(shape)
        bad.view(-1)[rng.randrange(bad.numel())] = rng.choice([float("nan"), float("inf")])
        return rng.choice(
            [
                junk(),
                bad,
                torch.ones(*shape, 2),
                encode("int8", torch.ones(shape[0] + 1, *shape[1:])),
                Encoded(rng.choice(["gzip", "int8", "topk"]), shape, (torch.ones(3),)),
            ]
        )

    return [
        lambda r: setattr(r, "trainer", rng.choice([-1, 7, "0", None, 1.0, True])),
        lambda r: setattr(r, "call", rng.choice([-5, "1", None, 2.0, 10**6])),
        lambda r: setattr(r, "grads_call", rng.choice([5, -2, "x", None])),
        lambda r: setattr(r, "final", junk()),
        lambda r: setattr(r, rng.choice(["dense_grads", "row_grads", "pull_rows"]), some_junk()),
        lambda r: r.dense_grads.update({dense: spoiled_grad()}),
        lambda r: r.dense_grads.update({"no.such": torch.ones(1)}),
        lambda r: r.row_grads.update({"user.weight": RowBlock(bad_ids(), torch.ones(1, 4))}),
        lambda r: r.row_grads.update({"user.weight": RowBlock(bad_packed(), torch.ones(2, 4))}),
        lambda r: r.row_grads.update(  # packed ids well formed, but not one per row
            {"user.weight": RowBlock(compact_ids(own_ids(endpoint, 0, 1, 2)), torch.ones(2, 4))}
        ),
        lambda r: r.pull_rows.update({"items.weight": bad_packed(rng.randint(1, 3))}),
        lambda r: r.row_grads.update({"user.weight": junk()}),
        lambda r: r.row_grads.update(
            {"user.weight": RowBlock(own_ids(endpoint, 0), rng.choice(GARBAGE[12:]))}
        ),
        lambda r: r.pull_rows.update({"items.weight": bad_ids()}),
        lambda r: r.pool_rows.update(
            {"items.weight": BagBlock(own_ids(endpoint, 0), torch.tensor([5]), 2)}
        ),
        lambda r: r.pool_rows.update({"items.weight": junk()}),
        lambda r: r.pooled_grads.update({"items.weight": PooledGrad(0, torch.ones(2, 4))}),
        lambda r: r.pull_versions.update({"user.weight": torch.tensor([0])}),
        lambda r: setattr(r, "report", TrainerReport(5, 1, 1, 0.0, 0.0, 0, 0)),
        lambda r: setattr(r, "packed_pulls", bad_tables(("items.weight",))),
        lambda r: setattr(
            r, "packed_grads", RowBlocks(bad_tables(("user.weight",)), {"user.weight": junk()})
        ),
        lambda r: setattr(
            r,
            "packed_grads",
            RowBlocks(pack_tables(["user.weight"], [own_ids(endpoint, 0, 1)]), {"x": junk()}),
        ),
        lambda r: setattr(r, "packed_grads", some_junk()),
    ]


def test_a_thousand_malformed_pushes_are_refused_and_change_nothing(
    make_server: MakeServer,
) -> None:
    rng = random.Random(0)
    endpoint = make_server()
    before = endpoint.shard.store.state_hash()
    spoilers = corruptions(endpoint, rng)
    kinds: dict[str, int] = {}
    for _ in range(1200):
        pushed, pulled = own_ids(endpoint, 0, 1), own_ids(endpoint, 0)
        if rng.random() < 1 / 3:  # every table's ids packed together, as trainers send them
            request = PushPullRequest(
                trainer=0,
                call=0,
                packed_grads=RowBlocks(
                    pack_tables(["user.weight"], [pushed]), {"user.weight": torch.ones(2, 4)}
                ),
                packed_pulls=pack_tables(["items.weight"], [pulled]),
            )
        else:
            pack = rng.choice([lambda ids: ids, compact_ids])  # plain, or packed a table at a time
            request = PushPullRequest(
                trainer=0,
                call=0,
                row_grads={"user.weight": RowBlock(pack(pushed), torch.ones(2, 4))},
                pull_rows={"items.weight": pack(pulled)},
            )
        for spoil in rng.sample(spoilers, rng.randint(1, 3)):
            with contextlib.suppress(AttributeError, TypeError):  # a field already junk
                spoil(request)
        future = endpoint.coordinator.push_pull(rng.choice([request] * 9 + [junk_request(rng)]))
        with pytest.raises(ParamServerError) as caught:
            future.wait()
        kinds[type(caught.value).__name__] = kinds.get(type(caught.value).__name__, 0) + 1
    assert endpoint.shard.store.state_hash() == before
    assert endpoint.shard.stats.pushes == 0
    assert kinds.get("InvalidPushError", 0) > 300  # most are caught by content checks


def junk_request(rng: random.Random) -> Any:
    return rng.choice([None, 1, "push", {"trainer": 0}, (0, 0), RowBlock(torch.ones(1), None)])  # type: ignore[arg-type]


def test_a_call_over_the_size_cap_is_refused(make_server: MakeServer) -> None:
    endpoint = make_server(max_message_mb=0.0002)  # 209 bytes
    before = endpoint.shard.store.state_hash()
    ids = own_ids(endpoint, *range(20))
    small = {"user.weight": RowBlock(own_ids(endpoint, 0), torch.ones(1, 4))}
    for wire in (ids, compact_ids(ids)):  # packed: 28 bytes on the wire, 160 once unpacked
        big = {"user.weight": RowBlock(wire, torch.ones(20, 4))}
        with pytest.raises(InvalidPushError, match="exceeds the cap"):
            endpoint.coordinator.push_pull(PushPullRequest(0, 0, row_grads=big)).wait()
    assert endpoint.shard.store.state_hash() == before
    endpoint.coordinator.push_pull(PushPullRequest(0, 0, row_grads=small)).wait()
    assert endpoint.shard.store.state_hash() != before
