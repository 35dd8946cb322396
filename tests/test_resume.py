"""Checkpoints in a job: exact resume in sync mode, resume on another server count, export."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import paramserver as ps
from paramserver.checkpoint import load_latest
from paramserver.cli import main
from paramserver.errors import JobFailedError
from paramserver.launch.threads import run_threads
from paramserver.trainer.client import gather_state
from tests.helpers import TinyRecModel, mse, tiny_batches

STEPS = 12


def config(tmp_path: Path, **options: Any) -> ps.TrainConfig:
    return ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="adam", lr=0.01, launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"), **options,
    )  # fmt: skip


def crashing_after(step: int, root: Path) -> Any:
    """Trainer 0's data ends in a crash at ``step + 1``, once checkpoint ``step`` is committed."""

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=STEPS)):
            if trainer == 0 and index == step + 1:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    found = load_latest(root) if (root / "LATEST").exists() else None
                    if found is not None and found.step == step:
                        break
                    time.sleep(0.01)
                raise RuntimeError("crash")
            yield batch

    return data


def final_state(job: ps.TrainConfig, data: Any) -> dict[str, dict[str, torch.Tensor]]:
    _, transport = run_threads(job, TinyRecModel, data, mse)
    return gather_state(transport, transport.endpoints[0].shard.plan, with_optimizer=True)


@pytest.mark.parametrize("saved_at", [1, STEPS // 2])
def test_sync_resume_is_exact(tmp_path: Path, saved_at: int) -> None:
    data = lambda t, n: tiny_batches(t, num_batches=STEPS)  # noqa: E731
    straight = final_state(config(tmp_path / "a"), data)
    job = config(tmp_path, checkpoint_every=saved_at)
    with pytest.raises(JobFailedError, match="crash"):
        run_threads(job, TinyRecModel, crashing_after(saved_at, tmp_path / "ckpt"), mse)
    found = load_latest(tmp_path / "ckpt")
    assert found is not None and found.step == saved_at
    manifest = (found.directory / "manifest.json").read_bytes()
    resumed = final_state(job.replace(resume=True), data)
    for name, entry in straight.items():
        for key, value in entry.items():
            assert torch.equal(value, resumed[name][key]), (name, key)
    if found.directory.exists():  # not pruned: the resumed job did not write it again
        assert (found.directory / "manifest.json").read_bytes() == manifest


def test_a_trainer_that_left_before_the_checkpoint_stays_finished_on_resume(
    tmp_path: Path,
) -> None:
    def uneven(trainer: int, num_trainers: int) -> Iterator[Any]:
        return tiny_batches(trainer, num_batches=3 if trainer == 1 else STEPS)

    def crashing(trainer: int, num_trainers: int) -> Iterator[Any]:
        return (
            crashing_after(6, tmp_path / "ckpt")(trainer, num_trainers)
            if trainer == 0
            else uneven(trainer, num_trainers)
        )

    straight = final_state(config(tmp_path / "a"), uneven)
    job = config(tmp_path, checkpoint_every=6)
    with pytest.raises(JobFailedError, match="crash"):
        run_threads(job, TinyRecModel, crashing, mse)
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
        run_threads(job, TinyRecModel, crashing_after(4, tmp_path / "ckpt"), mse)
    resumed = final_state(job.replace(resume=True, servers=3), data)
    for name, entry in straight.items():
        assert torch.allclose(entry["value"], resumed[name]["value"], atol=1e-6), name


def test_export_writes_a_plain_state_dict_and_check_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = config(tmp_path, checkpoint_every=3, checkpoint_keep=2)
    run_threads(job, TinyRecModel, lambda t, n: tiny_batches(t, num_batches=STEPS), mse)
    root = tmp_path / "ckpt"
    out = tmp_path / "model.pt"
    assert main(["export", str(root), str(out)]) == 0
    model = TinyRecModel()
    model.load_state_dict(torch.load(out, weights_only=True))  # plain tensors, every key
    newest = load_latest(root)
    # Due every 3 steps, but one at a time: a slow commit delays the next (3, 6, 9 when quick).
    assert newest is not None and 3 <= newest.step < 12  # 12 is the job's end
    assert main(["check", str(newest.directory)]) == 0
    # A flipped byte in the newest: check names the problem, and the root falls back.
    victim = newest.directory / "server-0.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert main(["check", str(newest.directory)]) == 1
    assert "server-0.pt" in capsys.readouterr().err
    assert main(["check", str(root)]) == 0
    fallback = capsys.readouterr().out
    assert "ok (step" in fallback and f"(step {newest.step}," not in fallback  # an older one
