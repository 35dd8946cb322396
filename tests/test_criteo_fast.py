"""The Criteo reader's fast path: its batches equal the line-by-line reader's, its errors name
the same lines, its reading thread never outlives its iterator, and a block parses without
fresh memory."""

from __future__ import annotations

import gc
import gzip
import math
import random
import resource
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch

from paramserver.cli import main
from paramserver.data import criteo, splits
from paramserver.data.blockparse import keep_freed_memory, parse_block
from paramserver.data.criteo import (
    MISSING_VALUE,
    NUM_CATEGORICAL,
    NUM_DENSE,
    CriteoFiles,
    hash_categorical,
    write_synthetic_criteo,
)
from paramserver.errors import InvalidBatchError
from paramserver.hashing import mix64_array, mix64_in_place
from tests.criteo_files import (
    HAND_LINES,
    criteo_line,
    numbered_line,
    read_all,
    reader_threads,
    write_uneven_files,
)

# ---- the fast reader against the line-by-line one ----


def assert_same_batches(fast: Iterable[criteo.Batch], slow: Iterable[criteo.Batch]) -> int:
    """The two readers' batches are equal tensor for tensor (values, dtypes, shapes); their
    number."""
    fast, slow = list(fast), list(slow)
    assert [len(label) for _, label in fast] == [len(label) for _, label in slow]
    for ((dense, sparse), label), ((dense_1, sparse_1), label_1) in zip(fast, slow, strict=True):
        for a, b in ((dense, dense_1), (sparse, sparse_1), (label, label_1)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
    return len(fast)


def random_field(rng: random.Random, kind: str) -> str:
    """A good field: a random width (often the longest, often empty), random digits."""
    if rng.random() < 0.15:
        return ""
    if kind == "int":
        digits = "".join(rng.choices("0123456789", k=rng.choice([1, 1, 2, 3, 8, 9, 17, 18])))
        return ("-" if rng.random() < 0.3 else "") + digits
    width = rng.choice([8, 8, 8, 1, 2, 5, 7])
    return "".join(rng.choices("0123456789abcdefABCDEF", k=width))


def random_good_lines(rng: random.Random, count: int) -> bytes:
    """Good lines of every width, some empty, some ending in \\r\\n or \\r\\r\\n."""
    text = []
    for _ in range(count):
        if rng.random() < 0.02:
            text.append(rng.choice(["", "\r"]))
            continue
        ints = [random_field(rng, "int") for _ in range(NUM_DENSE)]
        hexes = [random_field(rng, "hex") for _ in range(NUM_CATEGORICAL)]
        ending = rng.choices(["", "\r", "\r\r"], weights=[80, 19, 1])[0]
        text.append(criteo_line(rng.choice("01"), ints, hexes) + ending)
    return "\n".join(text).encode()  # the last line without its newline


@pytest.mark.system
@pytest.mark.parametrize("num_trainers", [1, 2, 3])
@pytest.mark.parametrize("batch_size", [1, 64, 1000])
def test_batches_are_the_line_by_line_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, num_trainers: int, batch_size: int
) -> None:
    # Small blocks: batches straddle blocks, and blocks straddle the trainers' cuts.
    monkeypatch.setattr(criteo, "BLOCK_BYTES", 4096)
    paths = write_uneven_files(tmp_path)
    paths.append(tmp_path / "random.txt")
    paths[-1].write_bytes(random_good_lines(random.Random(batch_size), 700))
    paths.append(tmp_path / "random.gz")
    paths[-1].write_bytes(gzip.compress(random_good_lines(random.Random(-batch_size), 500)))
    paths.append(tmp_path / "synthetic.txt")
    write_synthetic_criteo(paths[-1], 900, seed=batch_size)
    files = CriteoFiles(paths, batch_size=batch_size, hash_salt=batch_size)
    count = input_bytes = 0
    for t in range(num_trainers):
        fast = files.train_batches(t, num_trainers)
        count += assert_same_batches(fast, files.reference_batches(t, num_trainers))
        by_lines = splits.ShareReader(files.splits(t, num_trainers))
        for _ in by_lines.lines():
            pass
        assert fast.input_bytes == by_lines.input_bytes
        input_bytes += fast.input_bytes
    assert count >= num_trainers
    assert input_bytes == sum(path.stat().st_size for path in paths)
    assert not reader_threads()


def test_unusual_good_lines_are_read_as_line_by_line(tmp_path: Path) -> None:
    lines = [
        criteo_line("1", ["-0", "000000000000000012", "-999999999999999999"], ["0", "a", "F"]),
        criteo_line("0", ["123456789", "-12345678", "999999999999999999"], ["0000000", "1234"]),
        criteo_line("1", ["00000000", "-1", "-00000001"], ["ffffffff", "FFFFFFFF", "00000000"]),
        criteo_line("0", ["", "", ""], ["", "", "", "1"]) + "\r\r",  # left to the slow path
        "\r",  # an empty line
        criteo_line("1", ["7"] * NUM_DENSE, ["aBcD0123"] * NUM_CATEGORICAL) + "\r",
    ]
    path = tmp_path / "unusual"
    path.write_bytes("\n".join(lines).encode())
    files = CriteoFiles([path], batch_size=2)
    assert assert_same_batches(files.train_batches(0, 1), files.reference_batches(0, 1)) == 3
    dense, _, label = read_all(files)
    assert torch.equal(label, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    raw = torch.tensor([[0, 12, -999999999999999999], [123456789, -12345678, 999999999999999999]])
    assert torch.equal(dense[:2, :3], criteo.transform_dense(raw))
    assert dense[1, 0] == math.log1p(123456789)


def test_the_fast_parse_takes_a_block_whole_or_not_at_all() -> None:
    good = (HAND_LINES[0] + "\n" + HAND_LINES[1] + "\r\n\n" + HAND_LINES[2]).encode()
    columns = parse_block(good, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE)
    assert columns is not None and columns.labels.tolist() == [1.0, 0.0, 0.0]
    assert columns.ints.shape == (3, NUM_DENSE) and columns.hex_values.shape == (3, 26)
    assert columns.ints[0, :5].tolist() == [5, 0, -3, 0, 1000]
    assert columns.hex_values[0, :4].tolist() == [0x68FD1E64, 0x80E26C9B, MISSING_VALUE, 0x68FD1E64]
    assert parse_block(b"\n\r\n\n", NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE).labels.size == 0
    bad = good + b"\n" + criteo_line("1", ["0x1f"], []).encode()
    assert parse_block(bad, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE) is None


def test_the_fast_hash_is_hash_categorical() -> None:
    values = torch.randint(0, 1 << 32, (1000, NUM_CATEGORICAL), dtype=torch.int64)
    values[::7, 3] = MISSING_VALUE
    for salt in (0, 7, -(2**63), 2**64 - 1):
        hashed = criteo._hash_columns(values.numpy().astype(np.uint64), salt)
        assert torch.equal(torch.from_numpy(hashed), hash_categorical(values, salt))
    x = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, 10_000, dtype=np.int64)
    in_place = x.view(np.uint64).copy()
    mix64_in_place(in_place, np.empty_like(in_place))
    assert np.array_equal(in_place.view(np.int64), mix64_array(x))


def batches_until_error(batches: Iterable[criteo.Batch]) -> tuple[list[criteo.Batch], str]:
    taken = []
    with pytest.raises(InvalidBatchError) as raised:
        for batch in batches:
            taken.append(batch)
    return taken, str(raised.value)


def test_the_batches_before_a_bad_line_are_handed_out_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(criteo, "BLOCK_BYTES", 8192)
    path = tmp_path / "day_0"
    lines = [numbered_line(n) for n in range(1000)]
    lines[700] = criteo_line("1", [], ["xyz"])
    path.write_text("\n".join(lines) + "\n")
    files = CriteoFiles([path], batch_size=64)
    fast, fast_error = batches_until_error(files.train_batches(0, 1))
    slow, slow_error = batches_until_error(files.reference_batches(0, 1))
    assert fast_error == slow_error and "line 701:" in fast_error and "C1" in fast_error
    assert assert_same_batches(fast, slow) == 700 // 64
    assert not reader_threads()


def test_a_file_of_empty_lines_has_no_batches(tmp_path: Path) -> None:
    path = tmp_path / "empty_lines"
    path.write_bytes(b"\n\r\n\n" * 1000)
    batches = CriteoFiles([path]).train_batches(0, 1)
    assert list(batches) == [] and batches.input_bytes == path.stat().st_size


# ---- the reading thread ----


@pytest.mark.system
def test_no_reading_thread_outlives_its_iterator(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    write_synthetic_criteo(path, 20_000, seed=0)
    files = CriteoFiles([path], batch_size=64)
    assert not reader_threads()
    files.train_batches(0, 1)  # never iterated: no thread
    assert not reader_threads()
    for _ in files.train_batches(0, 1):  # a whole pass
        pass
    assert not reader_threads()
    stopped = files.train_batches(0, 1)
    next(stopped)
    assert len(reader_threads()) == 1
    stopped.close()  # a consumer that stops early
    assert not reader_threads() and next(stopped, None) is None
    for _ in files.train_batches(0, 1):
        break  # dropped without close()
    gc.collect()
    assert not reader_threads()


@pytest.mark.system
def test_a_cli_job_that_stops_early_leaves_no_reading_thread(tmp_path: Path) -> None:
    path = tmp_path / "day_0"
    write_synthetic_criteo(path, 20_000, seed=0)
    common = ["train", "--dataset", f"criteo:{path}", "--launcher", "threads", "--no-progress"]
    assert main([*common, "--steps", "3", "--trainers", "2", "--batch-size", "64"]) == 0
    gc.collect()
    assert not reader_threads()


def test_parsing_a_block_again_maps_no_fresh_memory() -> None:
    """Pages faulted in afresh for every block's arrays cost more than parsing them (see
    blockparse.keep_freed_memory): after the first blocks, the memory is reused."""
    if not keep_freed_memory():
        pytest.skip("not glibc's malloc")
    line = criteo_line("1", ["3", "-1", "12"], ["68fd1e64", "", "0a"]) + "\n"
    block = (line * (criteo.BLOCK_BYTES // len(line))).encode()
    for _ in range(3):
        parse_block(block, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(5):
        parse_block(block, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE)
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 5 * block.count(b"\n") / 100, faults  # glibc's defaults: about 1 in 2 lines
