"""Models too large for one process: ``gather_model`` refuses them before the job starts, and
``paramserver export`` streams a checkpoint's model to a plain state_dict file, server part by
server part, in about one table shard of memory, with the checkpoint's exact values."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver import api
from paramserver.checkpoint import Checkpoint, Saved, checkpoint_dir, commit, gather_saved
from paramserver.checkpoint import export as export_module
from paramserver.checkpoint.store import load_latest, write_part
from paramserver.cli import main
from paramserver.errors import CheckpointError, ConfigError
from paramserver.modelplan import plan_of
from paramserver.sharding import ShardPlan
from paramserver.store.snapshot import snapshot_store
from paramserver.trainer.loop import trainer_model
from tests.helpers import TinyRecModel, hashed_batches, mse, threads_job
from tests.procs import REPO

# --- gather_model on a model too large to gather ---------------------------------------------


class HugeModel(nn.Module):
    """10^11 rows x 16 (6.4 TB): built on the meta device, so the test costs nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.Embedding(10**11, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.items(ids)).squeeze(1)


def assert_names_the_way_out(message: str) -> None:
    for hint in (
        "gather_model=False",
        "--no-gather-model",
        "--checkpoint-dir",
        "paramserver export",
    ):
        assert hint in message, (hint, message)


def parameter_bytes(plan: ShardPlan) -> int:
    return sum(s.nbytes for s in plan.dense.values()) + sum(
        t.num_rows * t.dim * t.dtype.itemsize for t in plan.tables.values()
    )


def test_gathering_a_model_too_large_for_memory_is_refused_before_the_job_starts() -> None:
    started: list[int] = []

    def data_fn(trainer: int, num_trainers: int) -> Any:
        started.append(trainer)
        return iter([])

    config = ps.TrainConfig(servers=2, trainers=1, launcher="threads", progress=False)
    with pytest.raises(ConfigError) as refused:
        ps.train(HugeModel, data_fn, mse, config)
    plan = plan_of(trainer_model(HugeModel, 0), 2)
    assert_names_the_way_out(str(refused.value))
    assert f"take {parameter_bytes(plan) / 2**30:.1f} GiB" in str(refused.value)
    assert started == []  # no trainer ran
    api.check_gather_fits(plan, config.replace(gather_model=False))  # not gathered: fine


def test_the_rule_is_half_the_memory_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused when the fixed tables and dense parameters take over half of MemAvailable."""
    plan = plan_of(trainer_model(TinyRecModel, 0), 2)
    needed = parameter_bytes(plan)
    config = ps.TrainConfig(servers=2)
    monkeypatch.setattr(api, "available_memory", lambda: 2 * needed)
    api.check_gather_fits(plan, config)
    monkeypatch.setattr(api, "available_memory", lambda: 2 * needed - 2)
    with pytest.raises(ConfigError, match="gather_model"):
        api.check_gather_fits(plan, config)


def test_the_available_memory_is_read_from_meminfo() -> None:
    total = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < api.available_memory() <= total


def test_paramserver_train_refuses_it_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--rows-per-table", str(10**11), "--eval-samples", "64", "--no-progress"]
    assert main(argv) == 2
    assert_names_the_way_out(capsys.readouterr().err)


# --- paramserver export --------------------------------------------------------------------


class MixedModel(nn.Module):
    """A fixed table, a dynamic one and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.items = nn.EmbeddingBag(50, 4, mode="mean")
        self.hashed = ps.DynamicEmbedding(4, mode="mean")
        self.out = nn.Linear(8, 1)

    def forward(self, bags: Tensor) -> Tensor:
        return self.out(torch.cat([self.items(bags % 50), self.hashed(bags)], 1)).squeeze(1)


def committed(root: Path, saved: list[Saved]) -> Checkpoint:
    """A checkpoint of ``saved`` (server parts) under ``root``."""
    directory = checkpoint_dir(root, 1)
    parts = [write_part(directory, f"server-{m['server']}", t, m) for t, m in saved]
    commit(root, 1, parts, {"trainers": 1, "mode": "async"})
    found = load_latest(root)
    assert found is not None
    return found


@pytest.mark.parametrize("window_bytes", [64, export_module.WINDOW_BYTES])
def test_export_writes_the_checkpoints_values_in_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window_bytes: int
) -> None:
    """Trained on 3 servers (fixed, dynamic and dense, Adam state in the parts), exported with
    windows of a few rows or of all of them: every tensor equals the in-memory gather's, the
    dynamic ids are sorted, and the file loads into the model, also with mmap."""
    monkeypatch.setattr(export_module, "WINDOW_BYTES", window_bytes)
    config = ps.TrainConfig(
        servers=3, trainers=2, optimizer="adam", lr=0.01, launcher="threads", progress=False
    )
    _, transport = threads_job(config, MixedModel, lambda t, n: hashed_batches(t), mse)
    saved = [snapshot_store(endpoint.shard.store) for endpoint in transport.endpoints]
    found = committed(tmp_path / "ckpt", saved)
    out = tmp_path / "model.pt"
    assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    expected = gather_saved(saved)
    exported = torch.load(out, weights_only=True)
    assert list(exported) == list(expected)
    for name, value in expected.items():
        assert value.dtype == exported[name].dtype and torch.equal(value, exported[name]), name
    ids = exported["hashed.ids"]
    assert ids.numel() > 10 and bool((ids[1:] > ids[:-1]).all())
    assert exported["items.weight"].shape == (50, 4)
    model = MixedModel()
    model.load_state_dict(torch.load(out, weights_only=True, mmap=True))
    assert torch.equal(model.hashed.weight.detach(), expected["hashed.weight"])
    assert found.step == 1 and not list(tmp_path.glob(".model.pt.*"))  # no temporary left


def part(server: int, tables: dict[str, tuple[list[int], bool]]) -> Saved:
    """A hand-made server part: each table's ids (its rows hold the id in every column)."""
    tensors = {}
    for name, (ids, _) in tables.items():
        tensors[f"table/{name}/ids"] = torch.tensor(ids, dtype=torch.int64)
        tensors[f"table/{name}/value"] = torch.tensor(ids, dtype=torch.float32)[:, None].repeat(
            1, 3
        )
    meta = {
        "server": server,
        "num_servers": 2,
        "dense": [],
        "tables": {name: {"dynamic": dynamic} for name, (_, dynamic) in tables.items()},
    }
    return tensors, meta


@pytest.mark.parametrize(
    ("first", "second", "problem"),
    [
        (([0, 2, 4], False), ([1, 3, 6], False), "not rows 0..N-1"),
        (([0, 2, 4], False), ([1, 2, 5], False), "repeated"),
        (([9, 5], True), ([7, 5], True), "repeated"),
    ],
)
def test_export_refuses_rows_that_do_not_make_a_table(
    tmp_path: Path, first: Any, second: Any, problem: str
) -> None:
    found = committed(tmp_path, [part(0, {"t.weight": first}), part(1, {"t.weight": second})])
    with pytest.raises(CheckpointError, match=problem):
        export_module.export_checkpoint(found, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists() and not list(tmp_path.glob(".model.pt.*"))


def test_export_sorts_dynamic_rows_from_servers_of_uneven_sizes(tmp_path: Path) -> None:
    found = committed(
        tmp_path,
        [part(0, {"d.weight": ([40, 3, 17, 8, 99, 1], True)}), part(1, {"d.weight": ([], True)})],
    )
    export_module.export_checkpoint(found, tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported["d.ids"].tolist() == [1, 3, 8, 17, 40, 99]
    assert exported["d.weight"][:, 2].tolist() == [1, 3, 8, 17, 40, 99]


ROWS, DIM, SERVERS = 4_000_000, 16, 4  # 256 MB of float32 values, 64 MB per server
PEAK_RSS = """
import resource, sys
from paramserver.cli import main
assert main(["export", sys.argv[1], sys.argv[2]]) == 0
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def shard(server: int, rows: int) -> Tensor:
    g = torch.Generator().manual_seed(server)
    return torch.randn(len(range(server, rows, SERVERS)), DIM, generator=g)


def export_peak_rss(tmp_path: Path, name: str, rows: int) -> int:
    """Peak RSS of ``paramserver export`` in a fresh process, of a checkpoint of one table of
    ``rows`` rows over 4 servers (its parts written one at a time)."""
    root = tmp_path / name
    saved_parts = []
    for server in range(SERVERS):
        ids = torch.arange(server, rows, SERVERS)
        tensors = {"table/t.weight/ids": ids, "table/t.weight/value": shard(server, rows)}
        meta = {"server": server, "dense": [], "tables": {"t.weight": {"dynamic": False}}}
        saved_parts.append(write_part(checkpoint_dir(root, 1), f"server-{server}", tensors, meta))
        del tensors
    commit(root, 1, saved_parts, {})
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(root), str(tmp_path / f"{name}.pt")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


@pytest.mark.system
@pytest.mark.timeout(300)
def test_export_holds_about_one_shard_of_a_table_it_writes_whole(tmp_path: Path) -> None:
    """A 256 MB table over 4 servers exports in under half a table (one shard is a quarter)
    above the same export of a 1,000-row table, with the checkpoint's values."""
    small = export_peak_rss(tmp_path, "small", 1000)
    large = export_peak_rss(tmp_path, "large", ROWS)
    table_bytes = ROWS * DIM * 4
    assert large - small < table_bytes / 2, (large >> 20, small >> 20)
    exported = torch.load(tmp_path / "large.pt", weights_only=True, mmap=True)["t.weight"]
    assert exported.shape == (ROWS, DIM)
    for server in range(SERVERS):
        assert torch.equal(exported[server::SERVERS], shard(server, ROWS)), server


class SharedTable(nn.Module):
    """One item table read by two layers (a bag tied to the embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(30, 4)
        self.history = nn.EmbeddingBag(30, 4, mode="sum")
        self.history.weight = self.item.weight
        self.out = nn.Linear(8, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.cat([self.item(ids[:, 0]), self.history(ids)], 1)).squeeze(1)


def shared_table_batches(trainer: int) -> Iterator[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(trainer)
    for _ in range(4):
        yield torch.randint(0, 30, (8, 3), generator=g), torch.randn(8, generator=g)


def test_export_names_a_shared_table_by_each_of_its_names(tmp_path: Path) -> None:
    config = ps.TrainConfig(servers=2, trainers=1, launcher="threads", progress=False)
    _, transport = threads_job(config, SharedTable, lambda t, n: shared_table_batches(t), mse)
    saved = [snapshot_store(endpoint.shard.store) for endpoint in transport.endpoints]
    committed(tmp_path / "ckpt", saved)
    out = tmp_path / "model.pt"
    assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    exported = torch.load(out, weights_only=True)
    assert exported["history.weight"].data_ptr() == exported["item.weight"].data_ptr()
    model = SharedTable()
    model.load_state_dict(exported)  # strict: every name of the model is there
    assert torch.equal(model.item.weight.detach(), gather_saved(saved)["item.weight"])

    tensors, meta = saved[0]
    saved[0] = (tensors, {**meta, "aliases": {"history.weight": "no.such.weight"}})
    committed(tmp_path / "bad", saved)
    with pytest.raises(CheckpointError, match="malformed aliases"):
        export_module.export_checkpoint(load_latest(tmp_path / "bad"), tmp_path / "bad.pt")
