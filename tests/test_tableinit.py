"""Tables start as ``model_fn`` says, row by row, on any number of servers, without any process
building them whole (paramserver.tableinit, paramserver.modelplan.build_model)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver.launch.roles import build_server
from paramserver.modelplan import build_model, initial_model, plan_of, seeded_model
from paramserver.optim import make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.store.fixed import FixedTable
from paramserver.trainer.loop import trainer_model
from tests.procs import REPO

ROWS, DIM = 20_000, 16
SGD = OptimizerConfig(name="sgd", lr=0.1)


class Initialised(nn.Module):
    """One table per way of starting it, and a dense part."""

    def __init__(self) -> None:
        super().__init__()
        self.default = nn.Embedding(ROWS, DIM, padding_idx=7)
        self.normal = nn.Embedding(ROWS, DIM)
        nn.init.normal_(self.normal.weight, mean=0.5, std=0.01)
        self.uniform = nn.EmbeddingBag(ROWS, DIM)
        nn.init.uniform_(self.uniform.weight, -0.05, 0.05)
        self.truncated = nn.Embedding(ROWS, DIM)
        nn.init.trunc_normal_(self.truncated.weight, std=0.02, a=-0.03, b=0.03)
        self.constant = nn.Embedding(ROWS, DIM)
        nn.init.constant_(self.constant.weight, 0.25)
        self.xavier = nn.Embedding(ROWS, DIM)
        nn.init.xavier_uniform_(self.xavier.weight)
        self.scaled = nn.Embedding(ROWS, DIM)
        with torch.no_grad():
            self.scaled.weight.uniform_(0, 1).mul_(4).sub_(1).clamp_(max=2.0)
        self.given = nn.Embedding.from_pretrained(torch.arange(ROWS * 2.0).view(ROWS, 2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.default(ids)).squeeze(-1)


def shard_rows(model_fn: Callable[[], nn.Module], table: str, servers: int) -> Tensor:
    """Table ``table`` reassembled from the rows each of ``servers`` servers makes."""
    built = build_model(model_fn, seed=3)
    plan = plan_of(built.model, servers)
    spec = plan.tables[table]
    whole = torch.full((spec.num_rows, spec.dim), math.nan)
    for server in range(servers):
        shard = FixedTable(spec, plan, server, built.inits[table], make_rule(SGD))
        whole[shard.held_ids()] = shard.weight
    return whole


def test_a_table_starts_the_same_on_any_number_of_servers() -> None:
    on_one = shard_rows(Initialised, "normal.weight", 1)
    for servers in (2, 3, 4):
        assert torch.equal(shard_rows(Initialised, "normal.weight", servers), on_one)
    assert torch.equal(initial_model(Initialised, 3).normal.weight.detach(), on_one)


def test_rows_are_a_function_of_the_seed_the_table_and_the_row_alone() -> None:
    inits = build_model(Initialised, seed=0).inits
    ids = torch.tensor([19_999, 5, 0, 5, 123])
    some = inits["normal.weight"].rows(ids)
    assert torch.equal(some, inits["normal.weight"].rows(torch.arange(ROWS))[ids])
    assert torch.equal(some[1], some[3])
    other_seed = build_model(Initialised, seed=1).inits["normal.weight"].rows(ids)
    assert not torch.equal(some, other_seed)
    # Another table with the same recipe draws other values.
    scaled_default = inits["default.weight"].rows(ids) * 0.01 + 0.5
    assert not torch.allclose(scaled_default[:2], some[:2])


def close(value: float, expected: float, tolerance: float) -> bool:
    return abs(value - expected) <= tolerance


def test_each_table_keeps_the_distribution_model_fn_gave_it() -> None:
    model = initial_model(Initialised, seed=0)
    w = {name: m.weight.detach() for name, m in model.named_children() if name != "head"}
    n = ROWS * DIM
    default = w["default"][torch.arange(ROWS) != 7]
    assert close(float(default.mean()), 0.0, 5 / math.sqrt(n)) and close(
        float(default.std()), 1.0, 0.01
    )
    assert torch.equal(w["default"][7], torch.zeros(DIM))  # padding_idx's row, as nn.Embedding
    # A standard normal's tails: the share beyond 2 sigma is 4.55%.
    assert close(float((default.abs() > 2).float().mean()), 0.0455, 0.003)
    assert close(float(w["normal"].mean()), 0.5, 0.001) and close(
        float(w["normal"].std()), 0.01, 1e-4
    )
    uniform = w["uniform"]
    assert float(uniform.min()) >= -0.05 and float(uniform.max()) < 0.05
    assert close(float(uniform.std()), 0.1 / math.sqrt(12), 1e-3)
    truncated = w["truncated"]
    assert float(truncated.abs().max()) <= 0.03
    # N(0, 0.02) cut at +-1.5 sigma has std 0.02 * 0.7375 (the truncated normal's formula).
    assert close(float(truncated.std()), 0.02 * 0.7375, 3e-4)
    assert torch.equal(w["constant"], torch.full((ROWS, DIM), 0.25))
    bound = math.sqrt(6 / (ROWS + DIM))  # xavier_uniform_'s, from the table's shape
    assert float(w["xavier"].abs().max()) <= bound and float(w["xavier"].abs().max()) > 0.99 * bound
    scaled = w["scaled"]
    assert float(scaled.min()) >= -1 and float(scaled.max()) == 2.0
    assert close(float((scaled == 2.0).float().mean()), 0.25, 0.01)  # U(-1, 3) clamped at 2
    assert torch.equal(w["given"], torch.arange(ROWS * 2.0).view(ROWS, 2))


def test_no_process_builds_a_replayable_table_whole() -> None:
    built = build_model(Initialised, seed=0)
    assert all(
        m.weight.is_meta for n, m in built.model.named_children() if n not in ("head", "given")
    )
    assert trainer_model(Initialised, 0).normal.weight.is_meta


class Orthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Embedding(100, 8)
        self.rotated = nn.Embedding(100, 8)
        nn.init.orthogonal_(self.rotated.weight)

    def forward(self, ids: Tensor) -> Tensor:
        return self.plain(ids).sum(-1) + self.rotated(ids).sum(-1)


def test_an_init_that_cannot_replay_is_built_whole_once_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="paramserver.modelplan"):
        built = build_model(Orthogonal, seed=0)
    (warning,) = caplog.records
    assert "rotated.weight" in warning.getMessage() and "orthogonal_" in warning.getMessage()
    whole = seeded_model(Orthogonal, 0)
    rotated = built.inits["rotated.weight"].rows(torch.arange(100))
    assert torch.equal(rotated, whole.rotated.weight.detach())
    assert built.model.plain.weight.is_meta  # the other table still replays row by row
    q = rotated.T @ rotated
    torch.testing.assert_close(q, torch.eye(8), atol=1e-5, rtol=0)  # orthogonal columns


class ReadsItsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(50, 4)
        self.register_buffer("centre", self.table.weight.detach().mean(0))

    def forward(self, ids: Tensor) -> Tensor:
        return (self.table(ids) - self.centre).sum(-1)


def test_a_model_fn_that_needs_its_tables_values_is_built_whole_everywhere_alike() -> None:
    built = build_model(ReadsItsTable, seed=0)
    assert not built.model.table.weight.is_meta
    whole = seeded_model(ReadsItsTable, 0)
    assert torch.equal(
        built.inits["table.weight"].rows(torch.arange(50)), whole.table.weight.detach()
    )
    config = ps.TrainConfig(servers=2, trainers=1)
    endpoint = build_server(1, config, ReadsItsTable)
    try:
        table = endpoint.shard.store.tables["table.weight"]
        assert torch.equal(table.weight, whole.table.weight.detach()[1::2])
    finally:
        endpoint.coordinator.close()


def build_peak(role: str, rows: int, servers: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-m", "tests._build_peak", role, str(rows), str(servers)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_server_allocates_about_its_share_of_a_table() -> None:
    table_mib = 1_000_000 * 64 * 4 / 2**20  # 244 MiB whole
    quarter = build_peak("server", 1_000_000, 4)
    assert quarter["rows_held"] == 250_000
    assert quarter["growth_mib"] < 1.25 * table_mib / 4 + 10, quarter
    whole = build_peak("server", 1_000_000, 1)
    assert whole["growth_mib"] > table_mib  # the measure sees a table built whole


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_trainers_memory_does_not_grow_with_its_tables() -> None:
    small, large = build_peak("trainer", 1_000, 1), build_peak("trainer", 1_000_000, 1)
    assert large["growth_mib"] - small["growth_mib"] < 8, (small, large)


def test_given_values_keep_their_dtype_exactly() -> None:
    thirds = torch.arange(30, dtype=torch.float64).view(10, 3) / 3

    class Given(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding.from_pretrained(thirds, freeze=False)

    init = build_model(Given, seed=0).inits["table.weight"]
    assert torch.equal(init.rows(torch.tensor([4, 0])), thirds[[4, 0]])


BUILD_AND_LIST_HEAVY_IMPORTS = """
import sys
import paramserver
from paramserver.modelplan import build_model
from paramserver.models import DLRM
build_model(lambda: DLRM(table_rows=[1000, 1000]), 0)
build_model(lambda: DLRM(table_rows=[0, 0], dynamic_tables=True), 0)
print(sorted(m for m in ("torch._dynamo", "torchmetrics") if m in sys.modules))
"""


@pytest.mark.system
def test_building_a_model_loads_neither_torch_dynamo_nor_torchmetrics() -> None:
    """Each costs every process of a job about a second (dynamo) and half a second at its
    start: torch imports dynamo at a dispatch mode's first call and for a meta tensor's
    ``normal_``, and nothing but scoring needs torchmetrics."""
    done = subprocess.run(
        [sys.executable, "-c", BUILD_AND_LIST_HEAVY_IMPORTS],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.split("\n")[-2] == "[]"
