"""Checkpoints in a job: exact resume in sync mode (fixed and dynamic tables), resume on
another server count, export."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver.checkpoint import Checkpoint, load_latest
from paramserver.cli import main
from paramserver.errors import JobFailedError
from paramserver.launch.roles import build_server
from paramserver.modelplan import initial_model
from paramserver.trainer.client import gather_state
from tests.helpers import (
    NUM_ROWS_A,
    NUM_ROWS_B,
    TinyRecModel,
    crashing_after,
    mse,
    threads_job,
    tiny_batches,
)

STEPS = 12
COUNTERS = ("rows", "admitted", "evicted", "lookups", "pending_ids", "dropped_grads")


class HashedRecModel(nn.Module):
    """TinyRecModel with its item bags in a dynamic table that admits ids seen in 2 steps,
    expires rows untouched for 3 steps and evicts above 24 rows a server: each rule acts in
    a 12-step job of 2 trainers."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_ROWS_A, 4)
        self.items = ps.DynamicEmbedding(
            4, mode="mean", min_count=2, ttl_steps=3, capacity=24, init_scale=0.1
        )
        self.mlp = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user: Tensor, items: Tensor, dense: Tensor) -> Tensor:
        x = torch.cat([self.user(user), self.items(items), dense], dim=1)
        return self.mlp(x).squeeze(1)


class BatchNormedRecModel(nn.Module):
    """TinyRecModel with batch norm after its embeddings' concat: running statistics (buffers)
    that the chief trainer's pushes keep on the servers."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_ROWS_A, 4)
        self.items = nn.EmbeddingBag(NUM_ROWS_B, 4, mode="mean")
        self.mlp = nn.Sequential(
            nn.BatchNorm1d(8 + 3), nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1)
        )

    def forward(self, user: Tensor, items: Tensor, dense: Tensor) -> Tensor:
        x = torch.cat([self.user(user), self.items(items), dense], dim=1)
        return self.mlp(x).squeeze(1)


def hashed_batches(trainer: int, num_batches: int) -> Iterator[Any]:
    """tiny_batches with 90 item ids spread over the int64 range."""
    for (user, items, dense), target in tiny_batches(trainer, num_batches=num_batches):
        spread = (items + 30 * (user % 3).unsqueeze(1)) * 2_654_435_761 - 2**40
        yield (user, spread, dense), target


MODELS = {
    "fixed": (TinyRecModel, tiny_batches, {}),
    "dynamic": (HashedRecModel, hashed_batches, {}),
    # The resumed first call's bags must be known again for the pooled gradients that follow.
    "dynamic, pooled on the servers": (
        HashedRecModel,
        hashed_batches,
        {"server_pooling": ("items.weight",)},
    ),
    # The resumed job continues the chief's running statistics, as the servers hold them.
    "batch norm": (BatchNormedRecModel, tiny_batches, {}),
}


def config(tmp_path: Path, **options: Any) -> ps.TrainConfig:
    return ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="adam", lr=0.01, launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"), **options,
    )  # fmt: skip


def final_state(
    job: ps.TrainConfig, data: Any, model: Any = TinyRecModel
) -> dict[str, dict[str, torch.Tensor]]:
    return final_state_and_counters(job, data, model)[0]


def final_state_and_counters(
    job: ps.TrainConfig, data: Any, model: Any
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, int]]]:
    """Every parameter with its optimizer state, and each dynamic table's counters summed
    over the servers."""
    _, transport = threads_job(job, model, data, mse)
    state = gather_state(transport, transport.endpoints[0].shard.plan, with_optimizer=True)
    counters: dict[str, dict[str, int]] = {}
    for endpoint in transport.endpoints:
        for name, stats in endpoint.shard.store.table_stats().items():
            if "admitted" in stats:
                total = counters.setdefault(name, dict.fromkeys(COUNTERS, 0))
                for key in COUNTERS:
                    total[key] += stats[key]
    return state, counters


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("saved_at", [1, STEPS // 2])
def test_sync_resume_is_exact(tmp_path: Path, saved_at: int, kind: str) -> None:
    """Stopped after checkpoint ``saved_at`` and resumed, a sync job ends bitwise where an
    uninterrupted one does: values, optimizer state, dynamic rows and their counters."""
    model, batches, options = MODELS[kind]
    data = lambda t, n: batches(t, num_batches=STEPS)  # noqa: E731
    straight_job = config(tmp_path / "a", **options)
    straight, straight_counters = final_state_and_counters(straight_job, data, model)
    job = config(tmp_path, checkpoint_every=saved_at, **options)
    with pytest.raises(JobFailedError, match="crash"):
        threads_job(job, model, crashing_after(saved_at, tmp_path / "ckpt", batches, STEPS), mse)
    found = load_latest(tmp_path / "ckpt")
    assert found is not None and found.step == saved_at
    manifest = (found.directory / "manifest.json").read_bytes()
    resumed, resumed_counters = final_state_and_counters(job.replace(resume=True), data, model)
    for name, entry in straight.items():
        for key, value in entry.items():
            assert torch.equal(value, resumed[name][key]), (name, key)
    assert resumed_counters == straight_counters
    if model is HashedRecModel:  # every rule acted
        counted = straight_counters["items.weight"]
        assert counted["evicted"] > 0 and counted["pending_ids"] > 0, counted
        assert counted["admitted"] > counted["rows"], counted
    if model is BatchNormedRecModel:  # the statistics moved, and the chief's are the model's
        initial = initial_model(model, seed=0).state_dict()
        for name in ("mlp.0.running_mean", "mlp.0.running_var", "mlp.0.num_batches_tracked"):
            assert not torch.equal(straight[name]["value"], initial[name]), name
        assert int(straight["mlp.0.num_batches_tracked"]["value"]) == STEPS
    if found.directory.exists():  # not pruned: the resumed job did not write it again
        assert (found.directory / "manifest.json").read_bytes() == manifest


def overtaken(slow: int) -> Any:
    """hashed_batches, with trainer ``slow``'s first batch drawn only once the other trainer
    has its first answer (and a moment more): the other's call 1 then usually reaches the
    servers before ``slow``'s call 0."""
    answered = threading.Event()

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(hashed_batches(trainer, num_batches=STEPS)):
            if trainer == slow and index == 0:
                answered.wait(timeout=30)
                time.sleep(0.2)
            elif trainer != slow and index == 1:  # drawn once its call 0 is answered
                answered.set()
            yield batch

    return data


def test_a_dynamic_sync_job_is_reproducible(tmp_path: Path) -> None:
    """Trainers' first calls arrive in any order, also after another trainer's call 1;
    admission and eviction do not depend on it."""
    data = lambda t, n: hashed_batches(t, num_batches=STEPS)  # noqa: E731
    first = final_state_and_counters(config(tmp_path / "a"), data, HashedRecModel)
    for attempt, order in enumerate([overtaken(0), overtaken(1), data]):
        again = final_state_and_counters(config(tmp_path / str(attempt)), order, HashedRecModel)
        assert again[1] == first[1]
        for name, entry in first[0].items():
            for key, value in entry.items():
                assert torch.equal(value, again[0][name][key]), (name, key)


@pytest.mark.parametrize("left_after", [3, 6])
def test_a_trainer_that_left_before_the_checkpoint_stays_finished_on_resume(
    tmp_path: Path, left_after: int
) -> None:
    """Trainer 1's data ends before checkpoint 6 (its last push, in round 3 or in round 6
    itself): resumed, it leaves again without counting in any later round."""

    def uneven(trainer: int, num_trainers: int) -> Iterator[Any]:
        return tiny_batches(trainer, num_batches=left_after if trainer == 1 else STEPS)

    def crashing(trainer: int, num_trainers: int) -> Iterator[Any]:
        return (
            crashing_after(6, tmp_path / "ckpt", num_batches=STEPS)(trainer, num_trainers)
            if trainer == 0
            else uneven(trainer, num_trainers)
        )

    straight = final_state(config(tmp_path / "a"), uneven)
    job = config(tmp_path, checkpoint_every=6)
    with pytest.raises(JobFailedError, match="crash"):
        threads_job(job, TinyRecModel, crashing, mse)
    found = load_latest(tmp_path / "ckpt")
    assert found is not None and "trainer-1" not in found.part_names
    resumed = final_state(job.replace(resume=True), uneven)
    for name, entry in straight.items():
        for key, value in entry.items():
            assert torch.equal(value, resumed[name][key]), (name, key)


def test_a_checkpoint_resumes_on_another_server_count(tmp_path: Path) -> None:
    data = lambda t, n: tiny_batches(t, num_batches=STEPS)  # noqa: E731
    straight = final_state(config(tmp_path / "a"), data)
    job = config(tmp_path, checkpoint_every=4)
    with pytest.raises(JobFailedError):
        threads_job(job, TinyRecModel, crashing_after(4, tmp_path / "ckpt", num_batches=STEPS), mse)
    resumed = final_state(job.replace(resume=True, servers=3), data)
    for name, entry in straight.items():
        assert torch.allclose(entry["value"], resumed[name]["value"], atol=1e-6), name


def test_export_writes_a_plain_state_dict_and_check_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = config(tmp_path, checkpoint_every=3, checkpoint_keep=2)
    threads_job(job, TinyRecModel, lambda t, n: tiny_batches(t, num_batches=STEPS), mse)
    root = tmp_path / "ckpt"
    out = tmp_path / "model.pt"
    assert main(["export", str(root), str(out)]) == 0
    model = TinyRecModel()
    model.load_state_dict(torch.load(out, weights_only=True))  # plain tensors, every key
    newest = load_latest(root)
    assert newest is not None and (newest.step, newest.meta["final"]) == (12, True)  # the end
    assert main(["check", str(newest.directory)]) == 0
    # A flipped byte in the newest: check names the problem, and the root falls back.
    victim = newest.directory / "server-0.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["check", str(newest.directory)]) == 1
    assert "server-0.pt" in capsys.readouterr().err
    assert main(["check", str(root)]) == 3  # the newest is damaged, an older one loads
    fallback = capsys.readouterr().out
    assert f"{newest.directory}: DAMAGED" in fallback and "a resume loads ckpt-" in fallback
    assert "ok (step" in fallback and f"(step {newest.step}," not in fallback  # an older one


def test_a_server_reads_only_its_own_part_when_the_server_count_is_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = config(tmp_path, checkpoint_every=4)
    with pytest.raises(JobFailedError):
        threads_job(job, TinyRecModel, crashing_after(4, tmp_path / "ckpt", num_batches=STEPS), mse)
    read: list[str] = []
    original = Checkpoint.read_part

    def reading(self: Checkpoint, name: str) -> Any:
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(Checkpoint, "read_part", reading)
    for servers, parts in [(2, ["server-1"]), (3, ["server-0", "server-1"])]:
        read.clear()
        endpoint = build_server(1, job.replace(resume=True, servers=servers), TinyRecModel)
        endpoint.coordinator.close()
        assert read == parts, servers


@pytest.mark.parametrize(
    ("saved_mode", "trainers"), [("async", 3), ("async", 1), ("sync", 2), ("sync", 3)]
)
def test_an_async_job_continues_a_checkpoint_of_any_trainer_count_or_mode(
    tmp_path: Path, saved_mode: str, trainers: int
) -> None:
    """As many trainers: each from its own saved position. Another count: the steps the saved
    trainers had done are shared out, and each new trainer skips its share of its new split."""
    root = tmp_path / "ckpt"
    job = config(tmp_path, checkpoint_every=4).replace(mode=saved_mode)
    with pytest.raises(JobFailedError, match="crash"):
        threads_job(job, TinyRecModel, crashing_after(4, root, num_batches=STEPS), mse)
    found = load_latest(root)
    assert found is not None and found.meta["trainers"] == 2
    done = [int(found.read_part(f"trainer-{t}")[1]["steps_done"]) for t in range(2)]
    if trainers == 2:
        skipped = done
    else:
        skipped = [sum(done) // trainers + (t < sum(done) % trainers) for t in range(trainers)]
    resumed = job.replace(resume=True, mode="async", trainers=trainers)
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, STEPS), mse, resumed)
    assert result is not None and result.model is not None
    assert result.summary["trainer_steps"] == [STEPS - s for s in skipped]
    assert all(torch.isfinite(p).all() for p in result.model.parameters())
