"""Prefetch without staleness: a trainer applies its own latest update to the rows it
prefetched (``paramserver.trainer.ownupdates``), with the optimizer state the servers send
with them (``PushPullRequest.pull_state``)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import Tensor

import paramserver as ps
from paramserver import native, optim
from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.futures import completed
from paramserver.launch.roles import build_server
from paramserver.server.decoded import RowGrads
from paramserver.store.arena import ROW_HELD, ROW_STEPS
from paramserver.store.table import StateRead
from paramserver.trainer.client import InFlight, PSClient, Pulled, Traffic
from paramserver.trainer.kept import KeptCalls
from paramserver.trainer.ownupdates import Asked, OwnUpdates
from paramserver.trainer.routes import Route
from paramserver.trainer.rowstate import RowState, RowStates, joined_state
from paramserver.wire.compression import Encoded, error_bound, plain
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowStateBlock, state_key
from paramserver.wire.sizing import payload_size
from tests.factorization import RULES, Factorization, train
from tests.helpers import MakeServer, counted, own_ids


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_prefetching_trainer_learns_as_one_that_does_not(
    rule: str, loop_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One trainer: each step reads bitwise the rows and dense values it would without
    prefetch, so the model ends the same; without its own updates it would not (the test
    can fail). Either way: by the compiled loop (SGD, Adagrad, row-wise Adagrad) or torch."""
    unfetched = train(rule, prefetch=False)
    looped = counted(monkeypatch, "own_rows") if loop_mode == "compiled" else [0]
    fresh = train(rule)
    # Row-wise Adagrad's loop where it rounds as torch does (not on AVX-512): else torch.
    looped_rules = ("sgd", "adagrad") + (
        ("rowwise_adagrad",) if optim._rowwise_loop_agrees() else ()
    )
    compiled = loop_mode == "compiled" and rule in looped_rules
    assert (looped[0] > 0) == compiled
    stale = train(rule, prefetch_own_updates=False)
    for name, value in unfetched.items():
        assert torch.equal(fresh[name], value), name
    assert any(not torch.equal(stale[name], value) for name, value in unfetched.items())


@pytest.mark.parametrize("dynamic", [False, True])
def test_one_servers_answers_joined_in_one_pass_learn_as_without_prefetch(dynamic: bool) -> None:
    """With one server the state is joined from the masks end to end (no route): the model
    ends bitwise as without prefetch, fixed tables and dynamic ones (rows not held yet)."""
    unfetched = train("adagrad", dynamic=dynamic, servers=1, prefetch=False)
    fresh = train("adagrad", dynamic=dynamic, servers=1)
    for name, value in unfetched.items():
        assert torch.equal(fresh[name], value), name


def test_ids_without_a_row_take_no_update() -> None:
    """A dynamic table admits an id at its second sighting: a row not held yet takes no
    update on the trainer (it would leave the default vector), as on its server."""
    unfetched = train("adagrad", dynamic=True, prefetch=False)
    fresh = train("adagrad", dynamic=True)
    assert unfetched["users.ids"].numel() > 0
    for name, value in unfetched.items():
        assert torch.equal(fresh[name], value), name


def one_table_rows(name: str, state: RowState) -> RowStates:
    count = state.at.numel()
    return RowStates([name], state.at.numpy(), np.array([[0, count]]), state.parts)


def state_by_key(reply: PushPullReply) -> dict[str, Tensor | Encoded]:
    """An answer's row state by :func:`state_key`, each table's part of its block; a table's
    ROW_HELD only where some of its rows is not held."""
    by_key: dict[str, Tensor | Encoded] = {}
    for block in reply.row_state:
        assert block.malformed() is None
        ends = np.cumsum(block.counts).tolist()
        for name, count, end in zip(block.tables, block.counts, ends, strict=True):
            for part, value in block.parts.items():
                if type(value) is Encoded:
                    assert len(block.tables) == 1  # an encoded part is not sliced
                    by_key[state_key(name, part)] = value
                else:
                    by_key[state_key(name, part)] = value[end - count : end]
            if block.held is not None and not block.held[end - count : end].all():
                by_key[state_key(name, ROW_HELD)] = block.held[end - count : end]
    return by_key


@pytest.mark.parametrize("cached", [False, True])
def test_a_server_answers_the_state_of_the_rows_asked(cached: bool) -> None:
    """Fixed tables, read plainly or with cache versions, and a dynamic table with an id it
    holds no row for yet: the state of the rows the mask picks, in their order."""
    config = ps.TrainConfig(servers=1, trainers=1, optimizer="adam", cache_rows=8 if cached else 0)  # type: ignore[arg-type]
    endpoint = build_server(0, config, lambda: Factorization(dynamic=True))
    try:
        shard = endpoint.shard
        ids, asked = torch.tensor([0, 2, 4]), torch.tensor([True, False, True])
        request = PushPullRequest(0, 0, pull_dense=False)
        request.pull_rows = {name: ids for name in shard.store.tables}
        request.pull_state = {name: asked for name in shard.store.tables}
        if cached:
            request.pull_versions = {name: torch.full((3,), -1) for name in shard.store.tables}
        shard.read(request, train=True)  # the dynamic table sees each id once: no rows yet
        request.pull_rows["users.weight"] = torch.tensor([0, 2, 5])  # 5: first seen now
        reply = shard.read(request, train=True, clock=1)
        # The two tables of width 8 in one block (the bias table's are of width 1).
        assert reply.row_state[0].tables == ("users.weight", "items.weight")
        state = state_by_key(reply)
        held = state[state_key("users.weight", ROW_HELD)]
        assert held.tolist() == [True, False]  # ids 0 and 5
        for name, table in shard.store.tables.items():
            steps = state[state_key(name, ROW_STEPS)]
            assert steps.shape == (2,) and not steps.any()  # no update yet
            for slot in table.state:
                part = state[state_key(name, slot)]
                assert part.shape == (2, table.spec.dim) and not part.any()  # Adam's zeros
        # Once updated, a fixed row's state is its own.
        items = shard.store.tables["items.weight"]
        shard.apply({}, {"items.weight": RowGrads(ids, torch.ones(3, 8))}, step=0)
        state = state_by_key(shard.read(request, train=True))
        assert state_key("items.weight", ROW_HELD) not in state  # every row is
        for slot, values in items.state.items():
            got = state[state_key("items.weight", slot)]
            assert got.any() and torch.equal(got, values[ids[asked]])
        assert state[state_key("items.weight", ROW_STEPS)].tolist() == [1.0, 1.0]
    finally:
        endpoint.coordinator.close()


def test_the_trainer_joins_the_servers_state_of_the_rows_that_take_its_update() -> None:
    """Two servers' parts of the asked rows, with their places among the caller's ids; a row
    a server says does not take the update is left out. State that is not one entry per row
    asked, or of tables not asked, fails the call with a ParamServerError, rather than
    updating rows."""
    ids = torch.tensor([1, 2, 3, 4])  # server 0: 2 and 4, server 1: 1 and 3
    route = Route(ids, torch.tensor([1, 3, 0, 2]), [2, 2], (ids[[1, 3]], ids[[0, 2]]))
    routes, masks = {"t": route}, {"t": torch.tensor([True, True, False, True])}  # not 3
    replies = [PushPullReply(), PushPullReply()]
    replies[0].row_state = [RowStateBlock(("t",), (2,), {"sum": torch.tensor([[2.0], [4.0]])})]
    replies[1].row_state = [
        RowStateBlock(("t",), (1,), {"sum": torch.tensor([[1.0]])}, torch.tensor([False]))
    ]
    (joined,) = joined_state(replies, masks, routes)
    assert joined.names == ["t", "t"] and joined.spans.tolist() == [[0, 2], [2, 2]]
    state = joined.table(0)
    assert state.at.tolist() == [1, 3]  # ids 2 and 4; id 1 does not take it
    assert state.parts["sum"].flatten().tolist() == [2.0, 4.0]
    assert joined.table(1).at.numel() == 0
    replies[0].row_state[0] = RowStateBlock(("t",), (1,), {"sum": torch.zeros(1, 1)})
    with pytest.raises(ParamServerError, match="not one entry per row asked of it"):
        joined_state(replies, masks, routes)  # one row short
    replies[0].row_state[0] = RowStateBlock(("u",), (2,), {"sum": torch.zeros(2, 1)})
    with pytest.raises(ParamServerError, match="a table not asked for"):
        joined_state(replies, masks, routes)
    replies[0].row_state = []
    with pytest.raises(ParamServerError, match="not of the tables asked, each once"):
        joined_state(replies, masks, routes)  # a table left out


def test_a_malformed_row_state_block_is_named_before_it_is_read() -> None:
    good = RowStateBlock(
        ("a", "b"), (2, 1), {"sum": torch.zeros(3, 4)}, torch.ones(3, dtype=torch.bool)
    )
    assert PushPullReply(row_state=[good]).malformed() is None
    wrongs = {
        "tables must be a tuple": RowStateBlock(["a", "b"], (2, 1), good.parts),  # type: ignore[arg-type]
        "one count per table": RowStateBlock(("a", "b"), (3,), good.parts),
        "counts must be sizes": RowStateBlock(("a", "b"), (2, -1), good.parts),
        "parts must be a dict": RowStateBlock(("a", "b"), (2, 1), [torch.zeros(3, 4)]),  # type: ignore[arg-type]
        "'sum' is not one entry per row": RowStateBlock(("a", "b"), (2, 2), good.parts),
        "held rows are not one bool per row": RowStateBlock(
            ("a", "b"), (2, 1), good.parts, torch.ones(3)
        ),
    }
    for reason, wrong in wrongs.items():
        problem = PushPullReply(row_state=[wrong]).malformed()
        assert problem is not None and reason in problem, (reason, problem)
    assert PushPullReply(row_state={"a/sum": torch.zeros(1)}).malformed() is not None  # type: ignore[arg-type]


def test_one_servers_state_of_many_tables_is_joined_end_to_end_as_it_arrived(
    make_server: MakeServer,
) -> None:
    """From one server, every table's rows are found in one pass: each table's places and
    state as the server read them, the rows it says do not take the update left out, tables
    of other parts in a block of their own; through the wire and back."""
    g = torch.Generator().manual_seed(3)
    sizes = {"a": 5, "b": 0, "c": 7, "d": 4, "s": 6}  # s: plain SGD's, no slot
    masks = {name: torch.rand(size, generator=g) > 0.4 for name, size in sizes.items()}
    sent: dict[str, dict[str, Tensor]] = {}
    for name, mask in masks.items():
        asked = int(mask.sum())
        sent[name] = {} if name == "s" else {"sum": torch.rand(asked, 3, generator=g)}
        if name in ("c", "s"):
            sent[name][ROW_HELD] = torch.rand(asked, generator=g) > 0.5
    endpoint = make_server(0, servers=1, trainers=1)
    shard = endpoint.shard
    shard._state_codec = lambda table: "none"  # type: ignore[method-assign]
    reads = [StateRead([n], [int(masks[n].sum())], parts) for n, parts in sent.items()]
    reply = PushPullReply(row_state=shard._state_blocks(reads))
    assert [block.tables for block in reply.row_state] == [("a", "b", "c", "d"), ("s",)]
    routes = {n: Route(torch.arange(k), None, [k], (torch.arange(k),)) for n, k in sizes.items()}
    received = pickle.loads(pickle.dumps(reply))
    assert received.malformed() is None
    with_sums, without = joined_state([received], masks, routes)
    assert with_sums.names == ["a", "b", "c", "d"] and without.names == ["s"]
    assert without.parts == {}
    for joined in (with_sums, without):
        for j, name in enumerate(joined.names):
            state = joined.table(j)
            places = torch.nonzero(masks[name]).flatten()
            taking = sent[name].get(ROW_HELD, torch.ones(places.numel(), dtype=torch.bool))
            assert state.at.tolist() == places[taking].tolist(), name
            if name != "s":
                assert torch.equal(state.parts["sum"], sent[name]["sum"][taking])


def test_tables_of_one_arena_whose_state_travels_by_other_codecs_go_in_blocks_apart(
    make_server: MakeServer,
) -> None:
    """One read of an arena's tables (its state end to end) where one table's state travels
    int8 and the others' exact: that table's rows go in a block of their own, encoded; the
    others' in one block, as read."""
    sums = torch.rand(6, 4, generator=torch.Generator().manual_seed(4))
    read = StateRead(["a", "b", "c"], [2, 3, 1], {"sum": sums})
    shard = make_server(0, servers=1, trainers=1).shard
    shard._state_codec = lambda table: "int8" if table == "b" else "none"  # type: ignore[method-assign]
    exact, encoded = shard._state_blocks([read])
    assert (exact.tables, exact.counts, encoded.tables) == (("a", "c"), (2, 1), ("b",))
    assert torch.equal(exact.parts["sum"], sums[[0, 1, 5]])
    assert type(encoded.parts["sum"]) is Encoded
    bound = error_bound("int8", sums[2:5])
    assert ((plain(encoded.parts["sum"]) - sums[2:5]).abs() <= bound).all()
    shard._state_codec = lambda table: "none"  # type: ignore[method-assign]
    (whole,) = shard._state_blocks([read])  # one codec: the read as it is, not copied
    assert whole.tables == ("a", "b", "c") and whole.parts["sum"] is sums


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.tensor([1, 0]), "bool mask"),
        (torch.tensor([True]), "bool mask, one per id"),
        ("all", "must map names to values"),
    ],
)
def test_a_request_asking_state_badly_is_refused(
    make_server: MakeServer, mask: object, message: str
) -> None:
    server = make_server()
    ids = own_ids(server, 0, 1)
    request = PushPullRequest(0, 0, pull_rows={"user.weight": ids})
    request.pull_state = mask if isinstance(mask, str) else {"user.weight": mask}  # type: ignore[assignment]
    with pytest.raises(ParamServerError, match=message):
        server.coordinator.push_pull(request).wait()
    unpulled = PushPullRequest(0, 0, pull_state={"user.weight": torch.tensor([True])})
    with pytest.raises(InvalidPushError, match="row state asked without a pull"):
        server.coordinator.push_pull(unpulled).wait()


def test_a_dense_state_not_shaped_as_its_value_is_refused_by_the_trainer() -> None:
    """A dense value's state parts are shaped as it (its count 0-d), of a value sent."""
    reply = PushPullReply(dense={"w": torch.zeros(2, 3)})
    reply.dense_state = {
        state_key("w", "sum"): torch.zeros(2, 3),
        state_key("w", ROW_STEPS): torch.zeros(()),
    }
    in_flight = InFlight(
        PSClient.__new__(PSClient), [completed((reply, payload_size(reply)))], {}, {}, 1, {}, {}
    )
    in_flight.client.alarm, in_flight.client.traffic = None, Traffic()
    in_flight.client.kept = KeptCalls(1)
    assert set(in_flight.wait().dense_state["w"]) == {"sum", ROW_STEPS}
    reply.dense_state[state_key("w", "sum")] = torch.zeros(3)
    in_flight.result = None
    with pytest.raises(ParamServerError, match="dense state 'w/sum' is not shaped"):
        in_flight.wait()
    reply.dense_state = {state_key("v", ROW_STEPS): torch.zeros(())}  # no such dense value
    with pytest.raises(ParamServerError, match="dense state 'v/steps'"):
        in_flight.wait()


def test_the_update_finds_its_gradients_with_or_without_the_places_asked() -> None:
    """With the places the ask found, or searching (the step read rows on demand since), the
    same rows take the same update; a row without a gradient takes none."""
    config = ps.TrainConfig(optimizer="adagrad", lr=0.5)
    own = OwnUpdates.of(config, ["t"])
    following, pending = torch.tensor([1, 3, 5, 7]), torch.tensor([0, 3, 4, 7])
    asked = own.rows_to_ask({"t": following}, {"t": pending})
    assert asked.masks["t"].tolist() == [False, True, False, True]

    def updated(grad_ids: Tensor, known: Asked | None) -> Tensor:
        values = torch.ones(4, 2)
        pulled = Pulled(rows={"t": (following, values)})
        state = RowState(torch.tensor([1, 3]), {"sum": torch.zeros(2, 2)})
        pulled.row_state = [one_table_rows("t", state)]
        grads = torch.arange(2.0 * grad_ids.numel()).view(-1, 2) + 1
        own.apply(pulled, {}, {"t": (grad_ids, grads)}, 0, known)
        return values

    known = updated(pending, asked)
    assert torch.equal(known, updated(pending, None))
    assert known[[0, 2]].eq(1).all() and known[[1, 3]].ne(1).all()
    on_demand = updated(torch.tensor([0, 3, 4]), None)  # 7 has no gradient this time
    assert torch.equal(on_demand[:3], known[:3]) and on_demand[3].eq(1).all()


def test_a_fixed_table_of_plain_sgd_is_not_asked_and_takes_the_same_update() -> None:
    """Plain SGD reads no state and a fixed table's rows all take the update: the trainer asks
    the servers nothing for them and updates the rows the gradients touch, as it would with
    the servers' answer; a dynamic table's (whose rows may be new) is still asked."""
    config = ps.TrainConfig(optimizer="sgd", lr=0.5)
    own = OwnUpdates.of(config, ["t", "d"], fixed=["t"])
    following, pending = torch.tensor([1, 3, 5, 7]), torch.tensor([0, 3, 4, 7])
    asked = own.rows_to_ask({"t": following, "d": following}, {"t": pending, "d": pending})
    assert own.to_ask(asked.masks).keys() == {"d"}
    grads = torch.arange(8.0).view(4, 2) + 1

    def updated(row_state: list[RowStates]) -> Tensor:
        values = torch.ones(4, 2)
        pulled = Pulled(rows={"t": (following, values)}, row_state=row_state)
        own.apply(pulled, {}, {"t": (pending, grads)}, 0, asked)
        return values

    answered = updated([one_table_rows("t", RowState(torch.tensor([1, 3]), {}))])  # a server's
    assert torch.equal(updated([]), answered)
    assert answered[[0, 2]].eq(1).all() and answered[[1, 3]].ne(1).all()


@pytest.mark.parametrize(("rule", "lossy"), [("adagrad", True), ("adam", False)])
def test_row_state_travels_by_the_rows_codec_where_the_rule_takes_it_lossy(
    rule: str, lossy: bool
) -> None:
    """Under an int8 pull codec the rows' Adagrad sums go int8 (within the codec's bound) and
    the trainer decodes them; Adam's state goes exact (a variance rounded to 0 would blow its
    own update up); step counts always exact."""
    config = ps.TrainConfig(servers=1, trainers=1, optimizer=rule, table_pull_codec="int8")  # type: ignore[arg-type]
    endpoint = build_server(0, config, Factorization)
    try:
        shard, ids = endpoint.shard, torch.tensor([0, 2, 4])
        items = shard.store.tables["items.weight"]
        grads = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
        shard.apply({}, {"items.weight": RowGrads(ids, grads)}, step=0)
        request = PushPullRequest(0, 0, pull_dense=False)
        request.pull_rows = {"items.weight": ids}
        request.pull_state = {"items.weight": torch.tensor([True, False, True])}
        reply = shard.read(request, train=True)
        for slot, held in items.state.items():
            sent = state_by_key(reply)[state_key("items.weight", slot)]
            assert isinstance(sent, Encoded) == lossy, slot
            expected = held[ids[[0, 2]]]
            bound = error_bound("int8", expected) if lossy else torch.zeros_like(expected)
            assert ((plain(sent) - expected).abs() <= bound).all()
        if rule == "adam":
            assert isinstance(state_by_key(reply)[state_key("items.weight", ROW_STEPS)], Tensor)
        route = Route(ids, None, [3], (ids,))
        (rows,) = joined_state([reply], request.pull_state, {"items.weight": route})
        joined = rows.table(0)
        assert joined.at.tolist() == [0, 2] and all(
            isinstance(v, Tensor) for v in joined.parts.values()
        )
    finally:
        endpoint.coordinator.close()


def _rows_to_ask_per_table(
    following: dict[str, Tensor], pending: dict[str, Tensor]
) -> dict[str, tuple[Tensor, Tensor | None]]:
    """The search table by table (torch), as rows_to_ask did before it joined the tables."""
    expected: dict[str, tuple[Tensor, Tensor | None]] = {}
    for name, ids in following.items():
        touched = pending.get(name)
        if touched is None or not touched.numel():
            expected[name] = (torch.zeros(ids.numel(), dtype=torch.bool), None)
            continue
        at = torch.searchsorted(touched, ids).clamp(max=touched.numel() - 1)
        expected[name] = (touched[at] == ids, at)
    return expected


def test_rows_to_ask_searches_every_table_at_once_as_table_by_table(loop_mode: str) -> None:
    generator = torch.Generator().manual_seed(5)

    def ids(count: int, high: int) -> Tensor:
        return torch.randperm(high, generator=generator)[:count].sort().values

    wide = (ids(7, 20) - 10) * (1 << 40)  # ids far apart, some negative
    following = {"a": ids(50, 80), "b": ids(0, 10), "c": ids(30, 40), "d": wide,
                 "e": ids(20, 30), "f": ids(3, 5)}  # fmt: skip
    pending = {"a": ids(40, 80), "b": ids(5, 10), "c": torch.zeros(0, dtype=torch.int64),
               "d": torch.cat([wide[::2], torch.tensor([1 << 62])]), "f": ids(1, 5)}  # fmt: skip
    asked = OwnUpdates.rows_to_ask(following, pending)
    expected = _rows_to_ask_per_table(following, pending)
    assert set(asked.masks) == set(following)
    assert set(asked.places) == {"a", "b", "d", "f"}
    for name, (mask, at) in expected.items():
        assert torch.equal(asked.masks[name], mask), name
        if at is not None:
            touched, places = asked.places[name]
            assert touched is pending[name]
            assert torch.equal(torch.from_numpy(places), at), name
    assert asked.masks["a"].any() and asked.masks["d"].sum() == 4
    found = asked.masks.found  # the masks end to end, as one server's join takes them
    assert found is not None and found.tolist() == torch.cat(list(asked.masks.values())).tolist()
    assert asked.masks["c"].data_ptr() == found.ctypes.data + 50  # views of it: no copy
    assert OwnUpdates.rows_to_ask({}, pending).masks == {}


def test_the_compiled_search_refuses_sizes_that_do_not_fit_its_arrays() -> None:
    if native.loops is None:
        pytest.skip("the compiled loops are turned off (PARAMSERVER_NATIVE=0)")
    ids = np.arange(4, dtype=np.int64)
    at, found = np.empty(4, np.int64), np.empty(4, np.bool_)
    for value_sizes, other_sizes in [((3,), (4,)), ((2, 2), (4,)), ((5, -1), (4, 0))]:
        with pytest.raises(ValueError, match="places_each"):
            native.loops.places_each(ids, value_sizes, ids, other_sizes, at, found)
    native.loops.places_each(ids, (1, 3), ids, (0, 4), at, found)
    assert at.tolist() == [0, 1, 2, 3] and found.tolist() == [False, True, True, True]


def test_the_compiled_search_finds_values_in_any_order_as_numpy_does() -> None:
    if native.loops is None:
        pytest.skip("the compiled loops are turned off (PARAMSERVER_NATIVE=0)")
    rng = np.random.default_rng(3)
    others = np.unique(rng.integers(-50, 50, 40))
    values = np.concatenate([rng.integers(-60, 60, 200), np.sort(rng.integers(-60, 60, 100))])
    at, found = np.empty(values.size, np.int64), np.empty(values.size, np.bool_)
    # In any order (a binary search where one goes back), and ascending with repeats and
    # values past both ends (one merge).
    for each in (values, np.sort(values)):
        at, found = np.empty(each.size, np.int64), np.empty(each.size, np.bool_)
        native.loops.places_each(each, (each.size,), others, (others.size,), at, found)
        expected = np.minimum(np.searchsorted(others, each), others.size - 1)
        assert np.array_equal(at, expected)
        assert np.array_equal(found, others[expected] == each) and found.any() and not found.all()
