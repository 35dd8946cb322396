"""``--dense-sync allreduce``: dense parameters on the trainers, averaged by all-reduce; tables
on the servers."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import paramserver as ps
from paramserver.checkpoint import DENSE_PART, load_latest
from paramserver.modelplan import initial_model
from paramserver.transport.group import ThreadGroup, buckets
from tests.helpers import (
    PARITY_OPTIMIZERS,
    TinyRecModel,
    crashing_after,
    mse,
    tiny_batches,
    tiny_single_process,
    wait_for_checkpoint,
)
from tests.procs import children_of_launcher

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

NUM_TRAINERS = 3
NUM_STEPS = 20
OPTIMIZERS = PARITY_OPTIMIZERS
DENSE = ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")


def config(optimizer: str = "adagrad", **changes: Any) -> ps.TrainConfig:
    _, kwargs = OPTIMIZERS[optimizer]
    settings: dict[str, Any] = dict(
        servers=2, trainers=NUM_TRAINERS, mode="sync", optimizer=optimizer, lr=kwargs["lr"],
        momentum=kwargs.get("momentum", 0.0), dense_sync="allreduce", launcher="threads",
        progress=False,
    )  # fmt: skip
    settings.update(changes)
    return ps.TrainConfig(**settings)


def train(job: ps.TrainConfig, data: Any = None) -> ps.TrainResult:
    result = ps.train(TinyRecModel, data or (lambda t, n: tiny_batches(t)), mse, job)
    assert result is not None and result.model is not None
    return result


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sync_tables_and_all_reduced_dense_equal_single_process(optimizer: str) -> None:
    result = train(config(optimizer))
    assert result.summary["trainer_steps"] == [NUM_STEPS] * NUM_TRAINERS
    optimizer_class, kwargs = OPTIMIZERS[optimizer]
    expected = tiny_single_process((optimizer_class, kwargs), NUM_TRAINERS, NUM_STEPS)
    initial = initial_model(TinyRecModel, seed=0).state_dict()
    got = result.model.state_dict()  # type: ignore[union-attr]
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), f"{name} never moved: the test is vacuous"
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_all_reduce_equals_dense_on_servers_in_sync_mode() -> None:
    on_servers = train(config(dense_sync="server"))
    all_reduced = train(config())
    for name, value in on_servers.model.state_dict().items():  # type: ignore[union-attr]
        got = all_reduced.model.state_dict()[name]  # type: ignore[union-attr]
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=name)
    sent = [
        result.summary["calls"]["push_pull"]["sent_bytes"] for result in (on_servers, all_reduced)
    ]
    dense_bytes = sum(initial_model(TinyRecModel, 0).state_dict()[n].numel() * 4 for n in DENSE)
    # Each trainer's pushes lose the dense gradients of every step but the final call's.
    assert sent[0] - sent[1] >= NUM_TRAINERS * (NUM_STEPS - 1) * dense_bytes


@pytest.mark.parametrize(
    ("before", "after"),
    [("allreduce", "allreduce"), ("server", "allreduce"), ("allreduce", "server")],
)
def test_sync_resume_is_exact_and_may_switch_dense_sync(
    tmp_path: Path, before: str, after: str
) -> None:
    root = tmp_path / "ckpt"
    straight = train(config(dense_sync=after))
    job = config(checkpoint_dir=str(root), checkpoint_every=6)
    with pytest.raises(ps.JobFailedError, match="crash"):
        train(job.replace(dense_sync=before), crashing_after(6, root))
    found = load_latest(root)
    assert found is not None and found.step == 6
    assert (DENSE_PART in found.part_names) == (before == "allreduce")
    resumed = train(job.replace(dense_sync=after, resume=True))
    for name, value in straight.model.state_dict().items():  # type: ignore[union-attr]
        got = resumed.model.state_dict()[name]  # type: ignore[union-attr]
        if before == after:
            assert torch.equal(got, value), name
        else:  # the same math, on servers or trainers: equal up to float rounding
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=name)


def test_an_allreduce_checkpoint_exports_its_dense_parameters(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    result = train(config(checkpoint_dir=str(root), checkpoint_every=5, steps=10))
    found = load_latest(root)
    assert found is not None
    from paramserver.checkpoint.export import export_checkpoint

    export_checkpoint(found, tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(exported) == set(result.model.state_dict())  # type: ignore[union-attr]


def test_dense_codecs_are_refused_with_allreduce() -> None:
    with pytest.raises(ps.ConfigError, match="never travel"):
        config(dense_push_codec="int8")
    with pytest.raises(ps.ConfigError, match="--dense-sync"):
        config(dense_sync="ring")


def killed_once(victim: int, root: Path) -> Any:
    """Trainer ``victim`` kills its own process (SIGKILL) at its 8th batch, once checkpoint 5
    is committed, the first time only (the marker file is left for a restarted job)."""

    def data(trainer: int, num_trainers: int) -> Any:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=30)):
            if trainer == victim and index == 8 and not (root / "killed").exists():
                wait_for_checkpoint(root, 5)
                (root / "killed").touch()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
            yield batch

    return data


@pytest.mark.timeout(180)
def test_a_killed_trainer_stops_the_job_naming_it_and_it_resumes_from_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    job = config(
        launcher="processes", checkpoint_dir=str(root), checkpoint_every=5, max_restarts=1,
        heartbeat_interval=0.2, trainer_timeout=2.0,
    )  # fmt: skip
    summary = ps.train(TinyRecModel, killed_once(1, root), mse, job).summary  # type: ignore[union-attr]
    # The first run stopped at once, naming the killed trainer (not the all-reduce it broke).
    (stopped,) = summary["restarts"]
    assert stopped["process"] == "trainer1" and "SIGKILL" in stopped["exit"], stopped
    assert summary["trainer_steps"] == [30] * NUM_TRAINERS  # over both attempts
    assert children_of_launcher(os.getpid()) == []


def frozen_at(victim: int, index: int) -> Any:
    """Trainer ``victim`` stops its own process (SIGSTOP) at batch ``index``: frozen, alive."""

    def data(trainer: int, num_trainers: int) -> Any:
        for at, batch in enumerate(tiny_batches(trainer, num_batches=30)):
            if trainer == victim and at == index:
                os.kill(os.getpid(), signal.SIGSTOP)
            yield batch

    return data


@pytest.mark.timeout(120)
def test_a_frozen_trainer_stops_the_job_within_the_groups_timeout_naming_it() -> None:
    job = config(
        launcher="processes", heartbeat_interval=0.2, trainer_timeout=2.0, stall_timeout=4.0
    )
    started = time.monotonic()
    with pytest.raises(ps.JobFailedError, match=r"TrainerGroupError: trainer1 departed") as failed:
        ps.train(TinyRecModel, frozen_at(1, 5), mse, job)
    assert "all-reduce failed" in str(failed.value)
    assert time.monotonic() - started < 60  # the group's timeout is --stall-timeout, 4 s
    assert children_of_launcher(os.getpid()) == []


def test_gradients_are_reduced_in_buckets_of_one_dtype_up_to_the_limit() -> None:
    tensors = [
        torch.zeros(10),
        torch.zeros(20),
        torch.zeros(30),
        torch.zeros(5, dtype=torch.float64),
    ]
    runs = buckets(tensors, limit=30 * 4)
    assert [[t.numel() for t in run] for run in runs] == [[10, 20], [30], [5]]
    assert buckets([torch.zeros(100)], limit=8)[0][0].numel() == 100  # too large: alone


def test_a_thread_group_sums_in_rank_order_and_fails_when_aborted() -> None:
    group = ThreadGroup(3, timeout_s=5.0)
    values = {rank: [torch.tensor([float(rank), 1.0])] for rank in range(3)}
    threads = [
        threading.Thread(target=lambda r=rank: group.member(r).all_reduce_sum(values[r]).wait())
        for rank in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert all(torch.equal(values[r][0], torch.tensor([3.0, 3.0])) for r in range(3))
    group.abort()
    with pytest.raises(ps.TrainerGroupError, match="another trainer failed"):
        group.member(0).all_reduce_sum([torch.zeros(1)])


def test_trainers_with_unequal_data_end_like_dense_on_servers() -> None:
    """Trainers run out of data at steps 20, 13 and 7: each all-reduce averages over those
    still training, as a sync round on the servers aggregates the trainers still in it."""
    lengths = [20, 13, 7]

    def data(trainer: int, num_trainers: int) -> Any:
        return tiny_batches(trainer, num_batches=lengths[trainer])

    on_servers = train(config(dense_sync="server"), data)
    all_reduced = train(config(), data)
    assert all_reduced.summary["trainer_steps"] == lengths
    for name, value in on_servers.model.state_dict().items():  # type: ignore[union-attr]
        got = all_reduced.model.state_dict()[name]  # type: ignore[union-attr]
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=name)


def test_async_all_reduce_applies_a_step_late_as_prefetched_dense_values_are() -> None:
    """Prefetching (async), a step computes on all-reduced dense values one update behind:
    the trainer applies a step's mean only before the step after next, so its all-reduce
    runs during a whole step. So do dense values pulled from the servers where the trainer
    does not apply its own updates to what it prefetched. One trainer: the two are the same
    job."""
    one = {"trainers": 1, "mode": "async", "prefetch_own_updates": False}
    on_servers = train(config(dense_sync="server", **one))
    all_reduced = train(config(**one))
    for name, value in on_servers.model.state_dict().items():  # type: ignore[union-attr]
        got = all_reduced.model.state_dict()[name]  # type: ignore[union-attr]
        torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=name)
