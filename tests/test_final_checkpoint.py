"""The model a job ends with is always saved where the job has a checkpoint directory: its
final checkpoint (every server's shard once every trainer has finished, marked final) exports
to exactly the model the job gathered; ``paramserver export`` says which step it writes; a
resume from it trains no more; a job that keeps its model nowhere is warned at its start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import paramserver as ps
from paramserver.checkpoint import load_latest
from paramserver.cli import main
from tests.helpers import TinyRecModel, mse, tiny_batches


def data(trainer: int, num_trainers: int):
    return tiny_batches(trainer, 40)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_jobs_final_checkpoint_is_the_model_it_ends_with(tmp_path: Path, mode: str) -> None:
    config = ps.TrainConfig(
        servers=2, trainers=2, mode=mode, launcher="threads", progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=15,
    )  # fmt: skip
    result = ps.train(TinyRecModel, data, mse, config)
    assert result is not None and result.model is not None
    found = load_latest(tmp_path / "ckpt")
    assert found is not None and (found.step, found.meta["final"]) == (40, True)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    final = result.model.state_dict()
    assert exported.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(exported[name], value), name
    again = ps.train(TinyRecModel, data, mse, config.replace(resume=True))
    assert again is not None and again.summary["trainer_steps"] == [0, 0]  # nothing left
    assert load_latest(tmp_path / "ckpt").step == 40  # type: ignore[union-attr]
    for name, value in final.items():
        assert torch.equal(again.model.state_dict()[name], value), name  # type: ignore[union-attr]


def test_a_new_user_exports_the_step_the_job_ended_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the issue tried it: --checkpoint-dir alone used to write nothing, and with a
    checkpoint every 50 of 80 steps the export silently wrote step 50's model."""
    common = ["train", "--launcher", "threads", "--no-progress", "--servers", "1",
              "--trainers", "1", "--rows-per-table", "1000"]  # fmt: skip
    only_dir = tmp_path / "only"
    assert main([*common, "--checkpoint-dir", str(only_dir), "--train-batches", "40"]) == 0
    assert main(["export", str(only_dir), str(tmp_path / "a.pt")]) == 0
    assert "the model at step 40 (the job's final model)" in capsys.readouterr().out
    every = tmp_path / "every"
    argv = ["--checkpoint-dir", str(every), "--steps", "80", "--checkpoint-every", "50"]
    assert main([*common, *argv]) == 0
    assert main(["export", str(every / "ckpt-0000000050"), str(tmp_path / "b.pt")]) == 0
    assert "step 50 (saved during the job, which may have trained past it)" in (
        capsys.readouterr().out
    )
    assert main(["export", str(every), str(tmp_path / "c.pt")]) == 0
    assert "the model at step 80 (the job's final model)" in capsys.readouterr().out


def test_a_job_that_keeps_its_model_nowhere_is_warned_at_its_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ps.TrainConfig(
        servers=1, trainers=1, launcher="threads", progress=False, gather_model=False
    )
    with caplog.at_level(logging.WARNING, logger="paramserver.api"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, 2), mse, config)
    assert any("will be kept nowhere" in r.message for r in caplog.records)
