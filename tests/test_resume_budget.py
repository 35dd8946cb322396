"""A resume from a finished job's final checkpoint with a larger budget trains on to it, as
PyTorch Lightning (a larger ``max_epochs``/``max_steps``) and the Hugging Face Trainer do: more
data (``--train-batches``), more ``--epochs`` or more ``--steps`` (counted per trainer from the
job's start). In sync mode the job then ends bitwise where a job given that budget from the
start ends. A resume whose budget is already met says so in one line, with no NaN."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver.checkpoint import load_latest
from paramserver.cli import main
from paramserver.trainer import context
from tests.helpers import NUM_ROWS_A, NUM_ROWS_B, mse, tiny_batches

pytestmark = pytest.mark.system  # whole jobs, the command line's among them

# A small synthetic job on 1 server and 2 trainers: 40 batches are 20 steps per trainer.
JOB = (
    "train", "--launcher", "threads", "--no-progress", "--mode", "sync", "--servers", "1",
    "--trainers", "2", "--rows-per-table", "500", "--batch-size", "32", "--eval-samples", "256",
    "--lr-warmup-steps", "100",  # every step its own rate: a step applied late shows
)  # fmt: skip


def model_parts(root: Path) -> tuple[int, dict[str, Any]]:
    """The final checkpoint's step and what its servers' parts hold (values, optimizer state,
    counters, and their metadata: the clock among it): the model a job ends with."""
    found = load_latest(root)
    assert found is not None and found.meta.get("final")
    held: dict[str, Any] = {}
    for name in found.part_names:
        if name.startswith("server-"):
            part, meta = found.read_part(name)
            held.update({f"{name}/{key}": value for key, value in part.items()})
            held[f"{name}.json"] = meta
    return found.step, held


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a and a.keys() == b.keys()
    same = [torch.equal(a[n], b[n]) if isinstance(a[n], Tensor) else a[n] == b[n] for n in a]
    assert [name for name, equal in zip(a, same, strict=True) if not equal] == []


FIRST = ["--train-batches", "40"]
BUDGETS = {  # the first run's flags, the larger budget's, and the steps each trainer ends at
    "train-batches": (FIRST, ["--train-batches", "64"], 32),
    "steps": ([*FIRST, "--steps", "12"], [*FIRST, "--steps", "17"], 17),
    "epochs": (FIRST, [*FIRST, "--epochs", "2"], 40),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_resume_with_a_larger_budget_trains_on_to_it_bitwise(
    tmp_path: Path, budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first, larger, steps = BUDGETS[budget]
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    assert main([*JOB, *first, "--checkpoint-dir", str(resumed)]) == 0
    ended_at, _ = model_parts(resumed)
    summary = tmp_path / "summary.json"
    argv = [*larger, "--checkpoint-dir", str(resumed), "--resume", "--summary-json", str(summary)]
    capsys.readouterr()
    assert main([*JOB, *argv]) == 0
    printed = capsys.readouterr().out
    assert main([*JOB, *larger, "--checkpoint-dir", str(straight)]) == 0
    assert model_parts(resumed)[0] == model_parts(straight)[0] == steps  # sync: calls = steps
    assert_bitwise(model_parts(straight)[1], model_parts(resumed)[1])
    result = json.loads(summary.read_text())
    assert result["resumed_from"]["trainer_steps"] == [ended_at, ended_at]
    assert result["trainer_steps"] == [steps - ended_at] * 2
    assert math.isfinite(result["train_loss"])
    assert f"steps          {2 * (steps - ended_at)} " in printed and "nan" not in printed


@pytest.mark.timeout(60)
def test_a_resume_whose_budget_is_met_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    assert main([*JOB, "--train-batches", "40", "--checkpoint-dir", str(root)]) == 0
    manifest = (root / "ckpt-0000000020" / "manifest.json").read_bytes()
    capsys.readouterr()
    summary = tmp_path / "summary.json"
    # --steps counts a trainer's steps from the job's start: 40 is past the data's 20.
    again = ["--train-batches", "40", "--steps", "40", "--summary-json", str(summary)]
    with caplog.at_level(logging.INFO):
        assert main([*JOB, *again, "--checkpoint-dir", str(root), "--resume"]) == 0
    out = capsys.readouterr()
    [line] = out.out.splitlines()
    assert line.startswith("nothing to train: resumed from checkpoint 20, where the trainers")
    assert "20, 20 steps" in line
    assert "nan" not in (out.out + out.err + caplog.text).lower()
    assert json.loads(summary.read_text())["train_loss"] is None  # JSON has no NaN either
    assert (root / "ckpt-0000000020" / "manifest.json").read_bytes() == manifest
    assert load_latest(root).step == 20  # type: ignore[union-attr]
    assert not (root / "trainer-ends").exists()


class DropoutModel(nn.Module):
    """Tables and an MLP with dropout: training draws from the torch RNG every step."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_ROWS_A, 4)
        self.items = nn.EmbeddingBag(NUM_ROWS_B, 4, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(11, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 1))

    def forward(self, user: Tensor, items: Tensor, dense: Tensor) -> Tensor:
        x = torch.cat([self.user(user), self.items(items), dense], dim=1)
        return self.mlp(x).squeeze(1)


def batches(count: int) -> Any:
    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        return tiny_batches(trainer, num_batches=count)

    return data


@pytest.mark.timeout(120)
def test_the_api_trains_on_too_with_the_rng_where_the_job_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ps.train with ``resume`` behaves as the command: one trainer (the threads launcher's
    trainers share the process's RNG), whose dropout draws continue where they ended."""
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="sync", optimizer="adam", lr=0.01, launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip
    ps.train(DropoutModel, batches(6), mse, config)
    resumed = ps.train(DropoutModel, batches(10), mse, config.replace(resume=True))
    straight = ps.train(
        DropoutModel, batches(10), mse, config.replace(checkpoint_dir=str(tmp_path / "b"))
    )
    assert resumed is not None and straight is not None
    assert resumed.summary["trainer_steps"] == [4]
    assert resumed.model is not None and straight.model is not None
    expected = straight.model.state_dict()
    assert [
        n for n, v in expected.items() if not torch.equal(resumed.model.state_dict()[n], v)
    ] == []
    # The RNG states matter: a resume that did not restore them draws other dropout masks.
    monkeypatch.setattr(context, "set_rng_state", lambda tensors, meta: None)
    config = config.replace(checkpoint_dir=str(tmp_path / "c"))
    ps.train(DropoutModel, batches(6), mse, config)
    unrestored = ps.train(DropoutModel, batches(10), mse, config.replace(resume=True))
    assert unrestored is not None and unrestored.model is not None
    assert not all(torch.equal(unrestored.model.state_dict()[n], v) for n, v in expected.items())


@pytest.mark.timeout(120)
def test_an_async_resume_trains_on_from_each_trainers_end(tmp_path: Path) -> None:
    config = ps.TrainConfig(
        servers=1, trainers=2, mode="async", launcher="threads", progress=False,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip
    ps.train(DropoutModel, batches(5), mse, config)
    found = load_latest(tmp_path / "ckpt")
    assert found is not None and {"trainer-0", "trainer-1"} <= set(found.part_names)
    more = ps.train(DropoutModel, batches(9), mse, config.replace(resume=True))
    assert more is not None and more.summary["trainer_steps"] == [4, 4]
    assert more.summary["resumed_from"]["trainer_steps"] == [5, 5]
    assert load_latest(tmp_path / "ckpt").step > found.step  # type: ignore[union-attr]
