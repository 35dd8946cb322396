"""What several test modules share: small models and their data, test servers, checkpoints
written by hand. Processes live in tests/procs.py, fault-injecting doubles in tests/fakes.py,
fixtures in tests/conftest.py; no test module imports another."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import paramserver as ps
from paramserver import native
from paramserver.checkpoint import Part, checkpoint_dir, commit, load_latest, write_part
from paramserver.embedding import DynamicOptions
from paramserver.launch.roles import build_server
from paramserver.launch.threads import run_threads
from paramserver.modelplan import initial_model
from paramserver.optimconfig import OptimizerConfig
from paramserver.server.endpoint import ServerEndpoint
from paramserver.sharding import DenseSpec, ShardPlan, TableSpec
from paramserver.store.rowinit import init_rows
from paramserver.store.store import Store
from paramserver.store.table import Reading
from paramserver.tableinit import RowInit
from paramserver.trainer.lookups import StepLookups
from paramserver.trainer.loop import TrainerOutcome, default_loop
from paramserver.trainer.remote import RemoteEmbedding
from paramserver.transport.local import LocalTransport
from tests.fakes import FaultyTransport

NUM_ROWS_A = 40
NUM_ROWS_B = 30
NUM_IDS = 50  # ids HashedModel's data draws
EXTREMES = [-(2**63), -1, 0, 1, 2**63 - 1, 123456789012345678, -987654321098765432]
"""int64 ids at and near the ends of the range, for tables and maps that take any id."""


class TinyRecModel(nn.Module):
    """An embedding, a mean EmbeddingBag and a two-layer MLP: sparse and dense parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_ROWS_A, 4)
        self.items = nn.EmbeddingBag(NUM_ROWS_B, 4, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user: Tensor, items: Tensor, dense: Tensor) -> Tensor:
        x = torch.cat([self.user(user), self.items(items), dense], dim=1)
        return self.mlp(x).squeeze(1)


def tiny_batches(
    trainer: int, num_batches: int = 20, batch: int = 6, seed: int = 0
) -> Iterator[tuple[tuple[Tensor, Tensor, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + trainer)
    for _ in range(num_batches):
        user = torch.randint(0, NUM_ROWS_A, (batch,), generator=g)
        items = torch.randint(0, NUM_ROWS_B, (batch, 3), generator=g)
        dense = torch.randn(batch, 3, generator=g)
        target = torch.randn(batch, generator=g)
        yield (user, items, dense), target


def mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def nan_loss(output: Tensor, target: Tensor) -> Tensor:
    """A loss whose gradients are all NaN: servers must reject every push of it."""
    return (output * float("nan")).mean()


class HashedModel(nn.Module):
    """A bag of ids into a DynamicEmbedding (``dynamic``) or into a fixed table whose rows start
    where the dynamic table's init rule puts them, then a linear layer."""

    def __init__(self, dynamic: bool):
        super().__init__()
        self.out = nn.Linear(4, 1)  # first: both variants draw the same initial values for it
        if dynamic:
            self.emb: nn.Module = ps.DynamicEmbedding(4, mode="mean", init_scale=0.1)
        else:
            self.emb = nn.EmbeddingBag(NUM_IDS, 4, mode="mean")
            with torch.no_grad():
                options = DynamicOptions(init_scale=0.1)
                self.emb.weight.copy_(init_rows("emb.weight", options, torch.arange(NUM_IDS), 4))

    def forward(self, bags: Tensor) -> Tensor:
        return self.out(self.emb(bags)).squeeze(1)


def hashed_batches(trainer: int, num_batches: int = 12):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(trainer)
    for _ in range(num_batches):
        yield torch.randint(0, NUM_IDS, (8, 3), generator=g), torch.randn(8, generator=g)


# ---- test servers: one server's endpoint in this process, called directly ----

MakeServer = Callable[..., ServerEndpoint]  # the make_server fixture: new_server's arguments
# The faulty_jobs fixture: called with a rig that sets rules on each job's FaultyTransport.
FaultyJobs = Callable[[Callable[[FaultyTransport], object]], list[FaultyTransport]]


PARITY_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, float]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.02}),
}
"""Each rule the sync parity tests check, as torch.optim and its arguments (paramserver's
flags have the same names)."""


def crashing_after(
    step: int,
    root: Path,
    batches: Callable[..., Iterator[Any]] | None = None,
    num_batches: int = 20,
) -> Callable[[int, int], Iterator[Any]]:
    """A data_fn of ``batches`` (tiny_batches) whose trainer 0 crashes at batch ``step + 2``,
    once checkpoint ``step`` is committed. (A trainer draws a step's batch while the call before
    it is under way: it holds the answer that has it save checkpoint ``step`` only by the
    time it draws batch ``step + 2``.)"""
    make = batches or tiny_batches

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(make(trainer, num_batches=num_batches)):
            if trainer == 0 and index == step + 2:
                wait_for_checkpoint(root, step)
                raise RuntimeError("crash")
            yield batch

    return data


class LazyRows:
    """A model's tables as one Parameter per row, for a single-process reference: after the
    backward, :meth:`keep_touched` leaves a gradient only on the rows the batch looked up, so
    torch.optim skips the others, as a server's lazy per-row updates do (per-row Adam step
    counts included)."""

    def __init__(self, model: nn.Module, tables: Iterable[str]):
        weights = dict(model.named_parameters())
        self.model = model
        self.rows = {t: [nn.Parameter(row.clone()) for row in weights[t].detach()] for t in tables}
        self.dense = [p for n, p in weights.items() if n not in self.rows]

    def parameters(self) -> list[nn.Parameter]:
        """The dense parameters, then every table row."""
        return self.dense + [row for rows in self.rows.values() for row in rows]

    def weights(self) -> dict[str, Tensor]:
        """Each table's rows stacked, for ``functional_call(model, weights, inputs)``."""
        return {t: torch.stack(rows) for t, rows in self.rows.items()}

    def keep_touched(self, touched: dict[str, Tensor]) -> None:
        for table, ids in touched.items():
            keep = set(ids.unique().tolist())
            for i, row in enumerate(self.rows[table]):
                if i not in keep:
                    row.grad = None

    def state(self) -> dict[str, Tensor]:
        """The model's parameters now: dense ones and each table's rows stacked."""
        state = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        state.update({t: w.detach() for t, w in self.weights().items()})
        return state


Optimizing = Callable[["LazyRows"], tuple[torch.optim.Optimizer, object]]
"""Makes a reference's optimizer over a LazyRows' parameters, and its LambdaLR (or None)."""


def tiny_single_process(
    optimizing: Optimizing | tuple[type[torch.optim.Optimizer], dict[str, float]],
    num_trainers: int,
    num_steps: int,
) -> dict[str, Tensor]:
    """TinyRecModel trained by plain torch.optim on the concatenated global batch of
    ``num_trainers`` trainers' tiny_batches, its tables as :class:`LazyRows`. ``optimizing``:
    an optimizer class and its arguments over every parameter, or a function making the
    optimizer and its scheduler."""
    model = initial_model(TinyRecModel, seed=0)
    lazy = LazyRows(model, ("user.weight", "items.weight"))
    if isinstance(optimizing, tuple):
        optimizer_class, kwargs = optimizing
        optimizer, scheduler = optimizer_class(lazy.parameters(), **kwargs), None
    else:
        optimizer, scheduler = optimizing(lazy)
    streams = [tiny_batches(t) for t in range(num_trainers)]
    for _ in range(num_steps):
        batches = [next(s) for s in streams]
        inputs = tuple(torch.cat([b[0][i] for b in batches]) for i in range(3))
        target = torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        mse(functional_call(model, lazy.weights(), inputs), target).backward()
        lazy.keep_touched({"user.weight": inputs[0], "items.weight": inputs[1]})
        optimizer.step()
        if scheduler is not None:
            scheduler.step()  # type: ignore[attr-defined]
    return lazy.state()


def threads_job(
    config: ps.TrainConfig,
    model_fn: Callable[[], nn.Module],
    data_fn: Callable[[int, int], Iterator[tuple[object, Tensor]]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> tuple[TrainerOutcome, LocalTransport]:
    """``train()``'s loop under the threads launcher: the chief's outcome and the servers."""
    return run_threads(config, model_fn, default_loop(data_fn, loss_fn, config.epochs))


def new_server(
    server: int = 0, servers: int = 2, trainers: int = 2, mode: str = "async", **overrides: object
) -> ServerEndpoint:
    """Server ``server`` of a TinyRecModel job (sgd, lr 1: an update is the gradient itself).
    Its watchdog thread runs until ``endpoint.coordinator.close()``: tests take the
    ``make_server`` fixture (tests/conftest.py), which closes it after the test."""
    config = ps.TrainConfig(
        servers=servers, trainers=trainers, mode=mode, optimizer="sgd", lr=1.0, **overrides
    )  # type: ignore[arg-type]
    return build_server(server, config, TinyRecModel)


def own_ids(endpoint: ServerEndpoint, *ids: int) -> torch.Tensor:
    """The ``ids``-th rows this server holds of a fixed table (rows go round-robin)."""
    servers = endpoint.shard.plan.num_servers
    return torch.tensor([i * servers + endpoint.shard.server for i in ids], dtype=torch.int64)


def a_dense_name(endpoint: ServerEndpoint) -> str:
    """A dense parameter this server holds."""
    return sorted(endpoint.shard.store.dense)[0]


# ---- checkpoints written by hand, and damage done to them ----


def tensors_of(writer: int, step: int) -> dict[str, Tensor]:
    """Writer ``writer``'s tensors at ``step``: every dtype and layout a part must carry."""
    big = torch.arange(1000 * 8, dtype=torch.float32).reshape(1000, 8) + step
    return {
        "weight": torch.randn(5, 3, generator=torch.Generator().manual_seed(writer + 10 * step)),
        "ids": torch.arange(7, dtype=torch.int64) * (writer + step),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(float(writer + step)),
        "empty": torch.empty(0, 4),
        "view": big[10:20:3, 1:5].t(),  # non-contiguous, a view into an 8000-element storage
    }


def write_step(root: Path, step: int, num_writers: int = 3) -> list[Part]:
    directory = checkpoint_dir(root, step)
    return [
        write_part(directory, f"server-{w}", tensors_of(w, step), {"writer": w, "step": step})
        for w in range(num_writers)
    ]


def commit_step(root: Path, step: int, keep: int = 2) -> Path:
    return commit(root, step, write_step(root, step), {"step": step, "job": "test"}, keep=keep)


def checkpoint_steps(root: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("ckpt-")) for p in root.glob("ckpt-*"))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def wait_for_checkpoint(root: Path, step: int, timeout: float = 30.0) -> None:
    """Return once checkpoint ``step`` is the newest committed under ``root`` (a job's commit
    thread writes it: polled, every 10 ms); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = load_latest(root) if (root / "LATEST").exists() else None
        if found is not None and found.step == step:
            return
        if time.monotonic() > deadline:
            newest = None if found is None else found.step
            raise AssertionError(
                f"checkpoint {step} not committed in {timeout} s (newest: {newest})"
            )
        time.sleep(0.01)


class TwoTaskModel(nn.Module):
    """Click and conversion heads over one shared bottom: a multi-task recommendation model."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_ROWS_A, 4)
        self.items = nn.EmbeddingBag(NUM_ROWS_B, 4, mode="mean")
        self.bottom = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU())
        self.click = nn.Linear(8, 1)
        self.conversion = nn.Linear(8, 1)

    def forward(self, user: Tensor, items: Tensor, dense: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.bottom(torch.cat([self.user(user), self.items(items), dense], dim=1))
        return self.click(hidden).squeeze(1), self.conversion(hidden).squeeze(1)


def two_task_batches(
    trainer: int, num_batches: int = 20, batch: int = 6
) -> Iterator[dict[str, Tensor]]:
    """Batches as dicts: ids, dense features, a click and a conversion label."""
    g = torch.Generator().manual_seed(7000 + trainer)
    for _ in range(num_batches):
        yield {
            "user": torch.randint(0, NUM_ROWS_A, (batch,), generator=g),
            "items": torch.randint(0, NUM_ROWS_B, (batch, 3), generator=g),
            "dense": torch.randn(batch, 3, generator=g),
            "click": torch.randint(0, 2, (batch,), generator=g).float(),
            "conversion": torch.randint(0, 2, (batch,), generator=g).float(),
        }


AUX_L2 = 0.01


def two_task_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Both heads' losses and an L2 term on the user rows the batch looks up."""
    click, conversion = model(batch["user"], batch["items"], batch["dense"])
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    aux = AUX_L2 * model.user(batch["user"]).pow(2).mean()
    return bce(click, batch["click"]) + 0.5 * bce(conversion, batch["conversion"]) + aux


def two_task_loop(ctx: ps.TrainContext) -> dict[str, float]:
    """A user's loop: dict batches, two heads, an auxiliary term; returns its last loss."""
    loss = torch.tensor(0.0)
    inputs = lambda b: (b["user"], b["items"], b["dense"])  # noqa: E731
    for batch in ctx.batches(two_task_batches(ctx.rank), inputs):
        loss = two_task_loss(ctx.model, batch)
        loss.backward()
        ctx.step(loss)
    return {"rank": ctx.rank, "last_loss": float(loss.detach())}


def two_task_job(launcher: str) -> dict[str, object]:
    """The two-task loop in sync mode on 2 servers and 2 trainers under ``launcher``, dense
    parameters all-reduced among the trainers: the chief's final state, loop value and steps
    (empty on other torchrun ranks)."""
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="adam", lr=0.02, launcher=launcher,
        dense_sync="allreduce", progress=False,
    )  # fmt: skip
    result = ps.run(TwoTaskModel, two_task_loop, config)
    if result is None:
        return {}
    assert result.model is not None
    steps = result.summary["trainer_steps"]
    return {"state": result.model.state_dict(), "value": result.value, "steps": steps}


# ---- a small store (paramserver.store) ----


def make_store(servers: int = 1, server: int = 0) -> Store:
    """A fixed table ``fixed`` (20 rows), a dynamic table ``hashed`` (admitted at the second
    sighting, gone after 3 steps untouched) and one dense value, all under Adagrad."""
    tables = [
        TableSpec("fixed", 20, 4, torch.float32),
        TableSpec("hashed", 0, 4, torch.float32, dynamic=DynamicOptions(min_count=2, ttl_steps=3)),
    ]
    plan = ShardPlan([DenseSpec("w", (3,), torch.float32)], tables, num_servers=servers)
    rule = OptimizerConfig(name="adagrad", lr=0.5)
    inits = {"fixed": RowInit.given("fixed", torch.arange(80.0).view(20, 4))}
    dense = {"w": torch.ones(3)}
    return Store(server, plan, dense, inits, rule, {"fixed": rule, "hashed": rule})


def ids(*values: int) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def train_read(store: Store, clock: int, **wanted: Tensor) -> None:
    store.read(wanted, Reading(train=True, clock=clock))


RECOVER_BATCHES = 150


def slow_tiny_batches(trainer: int, num_trainers: int) -> Iterator[Any]:
    """``tiny_batches`` at about 50 a second: a job long enough to kill a server in."""
    for batch in tiny_batches(trainer, num_batches=RECOVER_BATCHES):
        time.sleep(0.02)
        yield batch


def recover_job_config(root: Path, mode: str, recover: bool, restarts: int = 0) -> ps.TrainConfig:
    """The job the recovery tests kill servers in (the same under every launcher)."""
    return ps.TrainConfig(
        servers=2, trainers=2, mode=mode, optimizer="adam", lr=0.01, launcher="processes",
        progress=False, publish_dir=str(root / "log"), publish_every=0.1, recover=recover,
        max_restarts=restarts, checkpoint_dir=str(root / "ckpt"), checkpoint_every=40,
        trainer_timeout=5.0,
    )  # fmt: skip


def remote_of(layer: nn.EmbeddingBag, pulled: Tensor) -> tuple[RemoteEmbedding, Tensor]:
    """``layer`` as a trainer's table, holding ``pulled`` (sorted ids) rows of its weight."""
    remote = RemoteEmbedding("t", layer)
    rows = layer.weight.detach()[pulled].clone().requires_grad_(True)
    remote.set_rows(pulled, rows)
    return remote, rows


@contextlib.contextmanager
def one_forward(step: StepLookups) -> Iterator[None]:
    """Within: one forward's lookups of ``step`` (a trainer's forward begins and ends them)."""
    step.begin()
    try:
        yield
    except BaseException:
        step.end(completed=False)
        raise
    step.end(completed=True)


def remotes_of(
    layers: Mapping[str, nn.EmbeddingBag], pulled: Mapping[str, Tensor]
) -> tuple[dict[str, RemoteEmbedding], dict[str, Tensor], StepLookups]:
    """``layers`` as a trainer's tables of those names, each holding its ``pulled`` rows
    (:func:`remote_of`), whose lookups within ``one_forward(step)`` join one
    :class:`StepLookups`: ``(remotes, rows, step)``."""
    remotes, rows = {}, {}
    for table, layer in layers.items():
        remotes[table], rows[table] = remote_of(layer, pulled[table])
        remotes[table].table = table
    step = StepLookups(remotes)
    for remote in remotes.values():
        remote.step_lookups = step
    return remotes, rows, step


def counted(monkeypatch: pytest.MonkeyPatch, loop: str) -> list[int]:
    """Count the calls of the compiled ``loop`` (a one-item list), so a test comparing the
    loops with numpy cannot pass without them."""
    calls = [0]
    original = getattr(native.loops, loop)

    def counting(*args: object) -> object:
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(native.loops, loop, counting)
    return calls
