"""The Criteo reader: parsing and transforms, id hashing, gzip, trainer splits, streaming, bad
lines, and the synthetic writer's planted signal."""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchmetrics.functional.classification import binary_auroc

from paramserver.cli import main
from paramserver.data import criteo, splits
from paramserver.data.blockparse import parse_block
from paramserver.data.criteo import (
    MISSING_VALUE,
    NUM_CATEGORICAL,
    NUM_DENSE,
    SIGNAL_CATEGORICAL,
    SIGNAL_DENSE,
    CriteoFiles,
    hash_categorical,
    write_synthetic_criteo,
)
from paramserver.errors import ConfigError, InvalidBatchError
from paramserver.hashing import mix64
from paramserver.trainer.loop import input_bytes_read
from paramserver.wire.reports import TrainerReport
from tests.criteo_files import (
    HAND_LINES,
    criteo_line,
    line_numbers,
    numbered_line,
    read_all,
    reader_threads,
    write_uneven_files,
)


def test_hand_written_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    # a CRLF line and trailing empty lines are accepted
    path.write_text(HAND_LINES[0] + "\r\n" + "\n".join(HAND_LINES[1:]) + "\n\n\n")
    batches = list(CriteoFiles([path], batch_size=3).train_batches(0, 1))
    assert [label.shape[0] for _, label in batches] == [3, 1]
    (dense, sparse), label = batches[0]
    assert dense.dtype == torch.float32 and dense.shape == (3, NUM_DENSE)
    assert sparse.dtype == torch.int64 and sparse.shape == (3, NUM_CATEGORICAL)
    dense, sparse, label = read_all(CriteoFiles([str(path)], batch_size=3))

    assert torch.equal(label, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    raw = [[int(x) if x else 0 for x in line.split("\t")[1:14]] for line in HAND_LINES]
    expected = torch.tensor([[math.log1p(max(x, 0)) for x in row] for row in raw])
    assert torch.equal(dense, expected.float())
    assert dense[0, 2] == 0.0 and dense[0, 1] == 0.0  # negative and missing both map to 0

    # equal (column, value) pairs share an id; equal strings in other columns do not
    assert sparse[0, 0] == sparse[1, 0]
    assert sparse[0, 0] != sparse[0, 3]
    assert sparse[0].unique().numel() == NUM_CATEGORICAL  # C1 and C4 hold the same string
    # missing: one fixed id per column, distinct across columns and from the value 0
    missing = hash_categorical(torch.full((1, NUM_CATEGORICAL), MISSING_VALUE))[0]
    assert torch.equal(sparse[2], missing)
    assert missing.unique().numel() == NUM_CATEGORICAL
    assert sparse[0, 2] == missing[2] and sparse[1, 1] == missing[1]
    assert sparse[1, 3] != missing[3]  # "00000000" is a value, not a missing field
    # the documented formula, with wrapping int64 arithmetic
    seed_0 = mix64(mix64(torch.tensor([0])) + torch.tensor([0]))
    assert sparse[0, 0] == mix64(mix64(torch.tensor([0x68FD1E64])) + seed_0)[0]
    assert sparse[3, 0] == mix64(mix64(torch.tensor([0xABCDEF01])) + seed_0)[0]  # upper case hex

    salted = read_all(CriteoFiles([path], batch_size=3, hash_salt=7))
    assert torch.equal(salted[0], dense) and torch.equal(salted[2], label)
    assert not torch.isin(salted[1], sparse).any()


def test_gzip_is_detected_by_content(tmp_path: Path) -> None:
    plain, packed = tmp_path / "plain.tsv", tmp_path / "packed.txt"  # gzip despite the name
    write_synthetic_criteo(plain, 700, seed=3)
    write_synthetic_criteo(packed, 700, seed=3, gzip=True)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    a = list(CriteoFiles([plain], batch_size=128).train_batches(0, 1))
    b = list(CriteoFiles([packed], batch_size=128).train_batches(0, 1))
    assert len(a) == len(b) == 6
    for ((dense_a, sparse_a), label_a), ((dense_b, sparse_b), label_b) in zip(a, b, strict=True):
        assert torch.equal(dense_a, dense_b)
        assert torch.equal(sparse_a, sparse_b)
        assert torch.equal(label_a, label_b)


def test_writer_is_deterministic(tmp_path: Path) -> None:
    for name, seed in [("a", 5), ("b", 5), ("c", 6)]:
        write_synthetic_criteo(tmp_path / name, 300, seed=seed, gzip=True)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert (tmp_path / "a").read_bytes() != (tmp_path / "c").read_bytes()


@pytest.mark.parametrize("num_trainers", [1, 2, 3])
def test_every_line_is_read_once_by_exactly_one_trainer(tmp_path: Path, num_trainers: int) -> None:
    paths = write_uneven_files(tmp_path)
    total_lines = 537 + 300 + 211 + 2 + 1000
    files = CriteoFiles(paths, batch_size=64)
    shares, input_bytes = [], []
    for t in range(num_trainers):
        batches = files.train_batches(t, num_trainers)
        share = list(batches)
        input_bytes.append(batches.input_bytes)
        # each trainer cuts its own lines into batches: only its last one may be short
        assert all(label.numel() == 64 for _, label in share[:-1])
        shares.append(line_numbers(share))
    # the shares laid end to end are the files' lines in order: every line exactly once
    assert [n for share in shares for n in share] == list(range(total_lines))
    assert sum(input_bytes) == sum(path.stat().st_size for path in paths)
    if num_trainers > 1:
        assert all(shares), "every trainer has lines to read"
    # a gzip file goes whole to one trainer
    splits = [files.splits(t, num_trainers) for t in range(num_trainers)]
    gzip_splits = [s for share in splits for s in share if s.path.name == "b.gz"]
    assert len(gzip_splits) == 1 and gzip_splits[0].is_gzip
    assert (gzip_splits[0].start, gzip_splits[0].end) == (0, paths[1].stat().st_size)
    assert not any(s.path.name == "c.txt" for share in splits for s in share)  # empty: no one


def test_a_file_with_fewer_lines_than_trainers(tmp_path: Path) -> None:
    path = tmp_path / "two_lines"
    path.write_text(numbered_line(0) + "\n" + numbered_line(1) + "\n")
    files = CriteoFiles([path], batch_size=8)
    shares = [line_numbers(files.train_batches(t, 5)) for t in range(5)]
    assert [n for share in shares for n in share] == [0, 1]
    assert sum(map(len, shares)) == 2 and max(map(len, shares)) == 1


@pytest.mark.parametrize("num_trainers", [2, 3, 6])
def test_a_cut_at_a_line_start_gives_that_line_to_the_later_range(
    tmp_path: Path, num_trainers: int
) -> None:
    path = tmp_path / "even"
    lines = [numbered_line(n) for n in range(10, 16)]  # all of one length
    path.write_text("".join(line + "\n" for line in lines))
    files = CriteoFiles([path], batch_size=8)
    cuts = [files.splits(t, num_trainers)[0].start for t in range(num_trainers)]
    assert all(cut % (len(lines[0]) + 1) == 0 for cut in cuts)  # every cut at a line start
    shares = [line_numbers(files.train_batches(t, num_trainers)) for t in range(num_trainers)]
    per_trainer = 6 // num_trainers
    assert shares == [
        list(range(10 + t * per_trainer, 10 + (t + 1) * per_trainer)) for t in range(num_trainers)
    ]


class CountingFileIO(io.FileIO):
    """A file that counts the bytes read from it, whatever the buffering above it."""

    bytes_read = 0

    def readinto(self, buffer: Any) -> int | None:
        n = super().readinto(buffer)
        CountingFileIO.bytes_read += n or 0
        return n


@pytest.mark.parametrize("num_trainers", [2, 3, 4, 7])
def test_one_large_plain_file_is_shared_evenly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_trainers: int
) -> None:
    path = tmp_path / "day_0"
    write_synthetic_criteo(path, 6000, seed=4)
    size = path.stat().st_size

    def counting_open(file: Path, mode: str = "rb", buffering: int = -1) -> Any:
        raw = CountingFileIO(file, mode)
        return raw if buffering == 0 else io.BufferedReader(raw)

    monkeypatch.setattr(splits, "open", counting_open, raising=False)
    files = CriteoFiles([path], batch_size=4096)
    input_bytes = []
    for t in range(num_trainers):
        CountingFileIO.bytes_read = 0
        batches = files.train_batches(t, num_trainers)
        for _ in batches:
            pass
        share = batches.input_bytes
        assert 0.9 * size / num_trainers <= share <= 1.1 * size / num_trainers
        # what it read from disk: its share, the line it skips and a buffer's read-ahead
        assert share <= CountingFileIO.bytes_read <= share + 3 * 8192, t
        input_bytes.append(share)
    assert sum(input_bytes) == size


def test_a_bad_line_deep_in_a_later_share_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "day_0.tsv"
    # empty lines and CRLF endings before the bad line: each still counts as one line
    lines = [numbered_line(n) + ("\r" if n % 7 == 0 else "") for n in range(3000)]
    for n in range(0, 3000, 97):
        lines[n] = ""

    def bad_at(number: int) -> CriteoFiles:
        """The file with line ``number`` (1-based) made bad by a label of 2 (same length)."""
        bad = list(lines)
        assert bad[number - 1].startswith("1")
        bad[number - 1] = "2" + bad[number - 1][1:]
        path.write_text("\n".join(bad) + "\n")
        assert path.stat().st_size == size
        return CriteoFiles([path], batch_size=128)

    path.write_text("\n".join(lines) + "\n")
    size = path.stat().st_size
    # line 2500 deep in trainer 1's half, and the first line trainer 1 of 2 owns
    cut = CriteoFiles([path]).splits(1, 2)[0].start
    data = path.read_bytes()
    first_owned = data.count(b"\n", 0, data.index(b"\n", cut - 1) + 1) + 1
    assert 1500 < first_owned < 1600
    for number in (2500, first_owned):
        files = bad_at(number)
        assert len(line_numbers(files.train_batches(0, 2))) > 1000  # trainer 0 reads no bad line
        with pytest.raises(InvalidBatchError, match=f"day_0.tsv, line {number}: .*label"):
            list(files.train_batches(1, 2))
    files = bad_at(2500)
    with pytest.raises(InvalidBatchError, match="line 2500:"):
        list(files.train_batches(2, 3))


def test_reading_streams_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big"
    line = criteo_line("1", ["3"] * NUM_DENSE, ["68fd1e64"] * NUM_CATEGORICAL) + "\n"
    path.write_text(line * 200_000)
    size = path.stat().st_size
    opened: list[io.BufferedReader] = []

    def recording_open(*args: Any, **kwargs: Any) -> Any:
        f = open(*args, **kwargs)  # noqa: SIM115 (closed by the reader)
        opened.append(f)
        return f

    monkeypatch.setattr(splits, "open", recording_open, raising=False)
    batches = CriteoFiles([path], batch_size=64).train_batches(0, 1)
    assert len(opened) == 1  # the magic bytes: nothing is read before the first next()
    _, label = next(batches)
    assert label.shape == (64,)
    assert len(opened) == 2  # one look at the magic bytes, then the reading
    # The first block's bytes are counted with its first batch.
    assert 0 < batches.input_bytes <= criteo.BLOCK_BYTES + len(line)
    # The reading thread runs ahead, but no more than the blocks it may hold: the one being
    # handed out, READ_AHEAD_BLOCKS queued and one parsed, each a block and the rest of a line
    # (read through an 8 KiB buffer).
    deadline = time.monotonic() + 30
    while opened[1].tell() <= 2 * criteo.BLOCK_BYTES:  # it does read ahead
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    bound = (criteo.READ_AHEAD_BLOCKS + 2) * (criteo.BLOCK_BYTES + 8192)
    assert opened[1].tell() <= bound < size // 10
    batches.close()
    assert all(f.closed for f in opened)
    assert not reader_threads()


@pytest.mark.parametrize(
    ("bad_line", "what"),
    [
        ("\t".join(HAND_LINES[0].split("\t")[:-1]), "expected 40 tab-separated fields, found 39"),
        (HAND_LINES[0] + "\t", "expected 40 tab-separated fields, found 41"),
        ("1 5", "expected 40 tab-separated fields, found 1"),
        (criteo_line("1", ["5", "2.5"], []), "I2"),
        (criteo_line("0", ["abc"], []), "I1"),
        (criteo_line("0", ["1" * 19], []), "I1"),
        (criteo_line("2", [], []), "label"),
        (criteo_line("", [], []), "label"),
        (criteo_line("1", [], ["68fd1e64", "zz12ab34"]), "C2"),
        (criteo_line("1", [], ["", "", "0x1234"]), "C3"),
        (criteo_line("1", [], ["123456789"]), "C1"),
        # Lines a vectorised parse could take by mistake: each is refused by it.
        (criteo_line("1", ["0x1f"], []), "I1"),  # hex with a prefix, which pyarrow reads
        (criteo_line("1", ["12", "+5"], []), "I2"),
        (criteo_line("1", [" 5"], []), "I1"),
        (criteo_line("1", ["-"], []), "I1"),
        (criteo_line("1", ["5-"], []), "I1"),
        (criteo_line("1", ["--5"], []), "I1"),
        (criteo_line("1", ["1a"], []), "I1"),
        (criteo_line("1", ["1234567890x"], []), "I1"),  # a long one: read by int()
        (criteo_line("1", ["0" * 19], []), "I1"),
        (criteo_line("1", ["-" + "1" * 19], []), "I1"),
        (criteo_line("1", [], ["-1234567"]), "C1"),
        (criteo_line("1", [], ["12\r34"]), "C1"),
        (criteo_line("1", [], ["", "abcdefg"]), "C2"),
        (criteo_line("1", [], ["12\x0034"]), "C1"),
        (criteo_line("1", [], ["12\u00e934"]), "C1"),  # not ASCII
        (criteo_line("01", [], []), "label"),
        (criteo_line("1\r", [], []), "label"),
        ("\ufeff" + criteo_line("1", [], []), "label"),  # a UTF-8 byte order mark
        ("\t" * 39, "label"),
        ("1", "expected 40 tab-separated fields, found 1"),  # no tab, but only allowed bytes
        ("ab12\r", "expected 40 tab-separated fields, found 1"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, bad_line: str, what: str) -> None:
    path = tmp_path / "broken.tsv"
    path.write_text("\n".join([HAND_LINES[0], "", HAND_LINES[1], bad_line, HAND_LINES[2]]) + "\n")
    block = (bad_line + "\n").encode()
    assert parse_block(block, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE) is None
    with pytest.raises(InvalidBatchError, match="line 4") as raised:
        list(CriteoFiles([path], batch_size=2).train_batches(0, 1))
    assert "broken.tsv" in str(raised.value) and what in str(raised.value)
    # on 2 trainers, only the one whose share holds line 4 reads it and raises
    raised_by = []
    for t in range(2):
        try:
            list(CriteoFiles([path], batch_size=2).train_batches(t, 2))
        except InvalidBatchError as e:
            assert "broken.tsv, line 4:" in str(e) and what in str(e)
            raised_by.append(t)
    assert len(raised_by) == 1


def test_corrupt_gzip_raises(tmp_path: Path) -> None:
    path = tmp_path / "cut.gz"
    write_synthetic_criteo(path, 2000, seed=0, gzip=True)
    path.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(InvalidBatchError, match="cut.gz.*corrupt gzip"):
        list(CriteoFiles([path], batch_size=256).train_batches(0, 1))


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dense, sparse, label


def fit_auc(train: Rows, test: Rows) -> float:
    """Held-out AUC on ``test`` of a logistic regression fit on ``train``: the dense features
    plus a learned bias per hashed id (ids taken mod a prime) of the signal columns."""
    torch.manual_seed(0)
    prime = 1009
    columns = list(SIGNAL_CATEGORICAL)

    def buckets(sparse: torch.Tensor) -> torch.Tensor:
        return sparse[:, columns].remainder(prime) + prime * torch.arange(len(columns))

    linear = nn.Linear(NUM_DENSE, 1)
    bias = nn.EmbeddingBag(prime * len(columns), 1, mode="sum")
    nn.init.zeros_(bias.weight)
    optimizer = torch.optim.Adam([*linear.parameters(), *bias.parameters()], lr=0.1)
    for _ in range(100):
        optimizer.zero_grad()
        logits = linear(train[0]).squeeze(1) + bias(buckets(train[1])).squeeze(1)
        nn.functional.binary_cross_entropy_with_logits(logits, train[2]).backward()
        optimizer.step()
    with torch.no_grad():
        logits = linear(test[0]).squeeze(1) + bias(buckets(test[1])).squeeze(1)
    return float(binary_auroc(logits, test[2].long()))


def split_rows(rows: Rows, at: int) -> tuple[Rows, Rows]:
    first = (rows[0][:at], rows[1][:at], rows[2][:at])
    return first, (rows[0][at:], rows[1][at:], rows[2][at:])


def test_input_bytes_are_read_from_epochs_that_count_them(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    write_synthetic_criteo(path, 500, seed=0)
    files = CriteoFiles([path], batch_size=100)
    epochs = [files.train_batches(1, 2), files.train_batches(1, 2)]
    for epoch in epochs:
        for _ in epoch:
            pass
    assert input_bytes_read(epochs) == 2 * epochs[0].input_bytes > 0
    assert input_bytes_read([*epochs, []]) is None  # a list does not count its bytes
    assert input_bytes_read([]) is None


def test_a_reports_input_bytes_are_an_int_or_none() -> None:
    assert TrainerReport(0, 1, 1, 0.5, 1.0, 0, 0).is_well_formed()  # None: not counted
    assert TrainerReport(0, 1, 1, 0.5, 1.0, 0, 0, input_bytes=123).is_well_formed()
    assert not TrainerReport(0, 1, 1, 0.5, 1.0, 0, 0, input_bytes=1.5).is_well_formed()  # type: ignore[arg-type]


@pytest.fixture
def one_thread() -> Iterator[None]:
    # The fit's tensors are tiny: extra intra-op threads only add synchronisation, which is
    # slow (seconds) on a host whose cores are busy with other work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.system
@pytest.mark.usefixtures("one_thread")
def test_planted_signal_is_learnable(tmp_path: Path) -> None:
    write_synthetic_criteo(tmp_path / "signal", 6000, seed=11)
    dense, sparse, label = read_all(CriteoFiles([tmp_path / "signal"], batch_size=4096))
    assert 0.15 < float(label.mean()) < 0.5
    assert (dense[:, list(SIGNAL_DENSE)] == 0).float().mean() > 0.1  # missing and -1 values
    auc = fit_auc(*split_rows((dense, sparse, label), 4000))
    shuffled = label[torch.randperm(label.numel(), generator=torch.Generator().manual_seed(0))]
    chance_auc = fit_auc(*split_rows((dense, sparse, shuffled), 4000))
    assert auc > 0.7, auc
    assert chance_auc < 0.56, chance_auc


@pytest.mark.system
@pytest.mark.usefixtures("one_thread")
def test_files_of_other_seeds_share_the_planted_signal_unless_told_otherwise(
    tmp_path: Path,
) -> None:
    write_synthetic_criteo(tmp_path / "train", 4000, seed=1)
    write_synthetic_criteo(tmp_path / "held_out", 2000, seed=2)  # signal_seed=0 as well
    write_synthetic_criteo(tmp_path / "other", 2000, seed=2, signal_seed=7)
    train, held_out, other = (
        read_all(CriteoFiles([tmp_path / name], batch_size=4096))
        for name in ("train", "held_out", "other")
    )
    # Other lines, from the same vocabularies (or, with another signal seed, other ones).
    assert not torch.equal(train[2][:2000], held_out[2])
    for column in range(NUM_CATEGORICAL):
        seen = train[1][:, column]
        assert torch.isin(held_out[1][:, column], seen).float().mean() > 0.5
        assert torch.isin(other[1][:, column], seen).float().mean() < 0.1  # missing ids only
    # A model of the training file scores held-out lines of the same signal better: their
    # categorical values carry the same effects (the dense features' weights are fixed).
    same, changed = fit_auc(train, held_out), fit_auc(train, other)
    assert same > 0.78 and same > changed + 0.05, (same, changed)
    # The same seed and another signal: the same integer features, other categorical values.
    assert torch.equal(held_out[0], other[0])


@pytest.mark.system
def test_a_criteo_job_is_compared_with_its_single_process_reference(tmp_path: Path) -> None:
    """Hashed ids in dynamic tables: the reference trains them in-process with the servers'
    table code; one trainer in sync mode reaches the same model, so the same AUC."""
    train, held_out = tmp_path / "train.txt", tmp_path / "eval.txt"
    write_synthetic_criteo(train, 2000, seed=1)
    write_synthetic_criteo(held_out, 1000, seed=2)
    summary = tmp_path / "summary.json"
    code = main(
        [
            "train", "--dataset", f"criteo:{train}", "--eval-data", str(held_out),
            "--launcher", "threads", "--servers", "1", "--trainers", "1", "--batch-size", "128",
            "--epochs", "2", "--mode", "sync", "--compare-single-process", "--no-progress",
            "--summary-json", str(summary),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(summary.read_text())
    reference = result["single_process"]
    assert reference["samples"] == result["samples"] == 4000
    assert abs(reference["eval_auc"] - result["eval_auc"]) < 1e-3, (reference, result)


@pytest.mark.system
def test_cli_trains_on_criteo_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain, train, held_out = tmp_path / "train.txt", tmp_path / "train.gz", tmp_path / "eval.txt"
    write_synthetic_criteo(plain, 3000, seed=3)
    write_synthetic_criteo(train, 3000, seed=1, gzip=True)
    write_synthetic_criteo(held_out, 2000, seed=2)
    files = CriteoFiles([plain, train], batch_size=128)
    shares = [files.train_batches(t, 2) for t in range(2)]
    batches_per_epoch = sum(len(list(share)) for share in shares)
    summary = tmp_path / "summary.json"
    code = main(
        [
            "train", "--dataset", f"criteo:{plain},{train}", "--eval-data", str(held_out),
            "--launcher", "threads", "--servers", "2", "--trainers", "2", "--batch-size", "128",
            "--epochs", "5", "--mode", "sync",  # deterministic: async AUC here spans 0.57-0.73
            "--no-progress", "--summary-json", str(summary),
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(summary.read_text())
    assert sum(result["trainer_steps"]) == 5 * batches_per_epoch
    # each trainer read its own share once per epoch: the files' bytes 5 times over, in all
    assert result["input_bytes"] == [5 * share.input_bytes for share in shares]
    assert sum(result["input_bytes"]) == 5 * (plain.stat().st_size + train.stat().st_size)
    assert result["eval_auc"] > 0.6  # the planted signal, learned through hashed ids
    assert result["tables"]["embeddings.0.weight"]["rows"] > 0
    assert main(["train", "--dataset", "criteo:/no/such/file"]) == 2
    assert "no such file" in capsys.readouterr().err


# ---- a held-out fraction ----


@pytest.mark.parametrize("num_trainers", [1, 2, 3])
def test_eval_fraction_holds_out_the_last_lines(tmp_path: Path, num_trainers: int) -> None:
    path = tmp_path / "day_0"
    path.write_text("".join(numbered_line(n) + "\n" for n in range(1000, 2000)))  # one length
    files = CriteoFiles([path], batch_size=100, eval_fraction=0.25)
    trained = [line_numbers(files.train_batches(t, num_trainers)) for t in range(num_trainers)]
    held_out = line_numbers(files.eval_batches())
    assert [n for share in trained for n in share] + held_out == list(range(1000, 2000))
    assert held_out == list(range(1750, 2000))  # the cut falls at a line start here
    assert len({len(share) for share in trained}) == 1  # the rest shared evenly
    assert line_numbers(files.eval_batches()) == held_out  # deterministic
    assert line_numbers(CriteoFiles([path]).eval_batches()) == []


def test_eval_fraction_never_cuts_a_gzip_file(tmp_path: Path) -> None:
    paths = write_uneven_files(tmp_path)  # a.txt 537 lines, b.gz 300, d.txt 211, e, f 1000
    files = CriteoFiles(paths, batch_size=64, eval_fraction=0.5)
    trained = line_numbers(files.train_batches(0, 1))
    held_out = line_numbers(files.eval_batches())
    assert trained + held_out == list(range(537 + 300 + 211 + 2 + 1000))
    assert 0 < len(held_out) < len(trained) + len(held_out)
    # b.gz lies whole on one side; a cut inside a plain file falls at a line start.
    assert {s.path.name for s in files.eval_splits()} <= {"d.txt", "e.txt", "f.txt"}
    only_gzip = CriteoFiles([paths[1]], eval_fraction=0.4)
    assert only_gzip.eval_splits() == [] and only_gzip.splits(0, 1)[0].path == paths[1]
    for fraction in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="eval_fraction"):
            CriteoFiles(paths, eval_fraction=fraction)


@pytest.mark.system
def test_cli_eval_fraction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, packed = tmp_path / "day_0", tmp_path / "day_0.gz"
    write_synthetic_criteo(path, 4000, seed=0)
    write_synthetic_criteo(packed, 4000, seed=0, gzip=True)
    summary = tmp_path / "summary.json"
    common = ["train", "--launcher", "threads", "--no-progress", "--batch-size", "128"]
    code = main(
        [*common, "--dataset", f"criteo:{path}", "--eval-fraction", "0.25", "--mode", "sync",
         "--epochs", "5", "--summary-json", str(summary)]
    )  # fmt: skip
    assert code == 0
    result = json.loads(summary.read_text())
    assert result["eval_auc"] > 0.6  # the planted signal, on held-out lines
    # The trainers read the first 75% of the file (to the held-out part's first line), 5 times.
    held_out = CriteoFiles([path], eval_fraction=0.25).eval_batches()
    assert 900 < sum(len(label) for _, label in held_out) < 1100
    assert sum(result["input_bytes"]) == 5 * (path.stat().st_size - held_out.input_bytes)
    plain, gz = ["--dataset", f"criteo:{path}"], ["--dataset", f"criteo:{packed}"]
    refused = {
        r"--eval-fraction must be in \(0, 1\)": [*plain, "--eval-fraction", "1.5"],
        "give one of them": [*plain, "--eval-fraction", "0.1", "--eval-data", str(path)],
        "criteo:PATH files, only": ["--eval-fraction", "0.1"],
        "holds out nothing": [*gz, "--eval-fraction", "0.1"],
        "leaves nothing to train on": [*gz, "--eval-fraction", "0.9"],
    }
    for message, flags in refused.items():
        assert main([*common, *flags]) == 2, message
        assert re.search(message, capsys.readouterr().err), message
