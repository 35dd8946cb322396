"""A folder that Criteo files keep arriving in (``criteo-follow:DIR``): files read once, in name
order, each taken once its ``.done`` marker exists, batches running on across files, a position
that a resume reads on from, late and deleted files skipped, many small files split across
trainers, and a whole job on it."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.cli import main
from paramserver.data.criteo import CriteoFiles, write_synthetic_criteo
from paramserver.inputs import STOP
from paramserver.streams import FolderReader, FollowedFolder

BATCH = 64


@pytest.fixture(autouse=True)
def not_stopped() -> Iterator[None]:
    STOP.clear()
    yield
    STOP.clear()


def arrive(directory: Path, name: str, lines: int, seed: int, done: bool = True) -> Path:
    path = directory / name
    write_synthetic_criteo(path, lines, seed=seed)
    if done:
        (directory / f"{name}.done").touch()
    return path


def sparse_of(batches: list[Any]) -> torch.Tensor:
    return torch.cat([inputs[1] for inputs, _ in batches])


def parsed(*paths: Path, trainer: int = 0, trainers: int = 1) -> torch.Tensor:
    """The categorical ids of these files' lines, as the file reader parses them."""
    return torch.cat(
        [sparse_of(list(CriteoFiles([p], 10**6).train_batches(trainer, trainers))) for p in paths]
    )


def drain(reader: FolderReader) -> list[Any]:
    """The batches it has left once asked to stop."""
    STOP.set()
    return list(reader)


def test_files_are_read_once_in_name_order_each_once_it_is_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    second = arrive(tmp_path, "02.csv", 300, seed=2)
    third = arrive(tmp_path, "03.csv", 200, seed=3, done=False)  # still being written
    reader = FollowedFolder(tmp_path, BATCH, poll_s=0.02)(0, 1)
    first_batches = list(itertools.islice(reader, 4))
    assert torch.equal(sparse_of(first_batches), parsed(second)[: 4 * BATCH])
    assert reader.position() == {"id": ["02.csv", 4 * BATCH], "records": 256, "bad_records": 0}
    arrive(tmp_path, "01.csv", 100, seed=1)  # complete after 02.csv was read: out of order
    (tmp_path / "03.csv.done").touch()
    rest = [*itertools.islice(reader, 3), *drain(reader)]
    assert torch.equal(sparse_of(first_batches + rest), parsed(second, third)[: 7 * BATCH])
    assert "01.csv completed after 02.csv was read: out of name order, skipped" in caplog.text


def test_a_reader_resumed_at_its_position_reads_on_from_the_next_row(tmp_path: Path) -> None:
    arrive(tmp_path, "a.csv", 150, seed=1)
    arrive(tmp_path, "b.csv", 150, seed=2)
    source = FollowedFolder(tmp_path, BATCH, poll_s=0.02)
    reader = source(0, 1)
    head = list(itertools.islice(reader, 2))
    position = reader.position()
    assert position is not None and position["id"] == ["a.csv", 128]
    unsaved = list(itertools.islice(reader, 2))  # trained after the checkpoint, then lost
    reader.close()
    again = source(0, 1)
    again.seek(position)
    rest = list(itertools.islice(again, 2))
    assert torch.equal(sparse_of(rest), sparse_of(unsaved))  # the same batches again
    assert torch.equal(sparse_of(head + rest), parsed(tmp_path / "a.csv", tmp_path / "b.csv")[:256])
    again.close()


def test_a_file_deleted_before_it_is_read_is_skipped(tmp_path: Path) -> None:
    kept = arrive(tmp_path, "a.csv", 2 * BATCH, seed=1)
    arrive(tmp_path, "b.csv", 2 * BATCH, seed=2).unlink()  # its marker stays
    reader = FollowedFolder(tmp_path, BATCH, poll_s=0.02)(0, 1)
    batches = [*itertools.islice(reader, 2), *drain(reader)]
    assert torch.equal(sparse_of(batches), parsed(kept))


def test_many_small_files_are_shared_by_the_trainers_in_full_batches(tmp_path: Path) -> None:
    paths = [arrive(tmp_path, f"part-{i:04d}", 7, seed=i) for i in range(120)]
    source = FollowedFolder(tmp_path, 16, poll_s=0.02)
    shares = []
    for trainer in (0, 1):
        reader = source(trainer, 2)
        batches = [*itertools.islice(reader, 20), *drain(reader)]
        STOP.clear()
        assert all(len(labels) == 16 for _, labels in batches)  # full batches across files
        expected = torch.cat([parsed(p, trainer=trainer, trainers=2) for p in paths])
        assert torch.equal(sparse_of(batches), expected[: len(batches) * 16])
        shares.append(len(expected))
    assert sum(shares) == 120 * 7  # every line in one trainer's share


def test_a_job_trains_on_a_followed_folder_and_stops_at_its_steps(tmp_path: Path) -> None:
    arrive(tmp_path, "2026-12-06T00.csv", 1000, seed=1)
    summary = tmp_path / "summary.json"
    job = ("--launcher", "threads", "--dataset", f"criteo-follow:{tmp_path}", "--batch-size", "100")
    code = main(["train", *job, "--steps", "4", "--no-progress", "--summary-json", str(summary)])
    assert code == 0
    figures = json.loads(summary.read_text())
    assert figures["samples"] == 800  # 2 trainers, 4 steps of 100
    assert figures["stream"]["records"] == 800 and figures["stream"]["bad_records"] == 0
    assert [end["id"][0] for end in figures["stream"]["positions"]] == ["2026-12-06T00.csv"] * 2
