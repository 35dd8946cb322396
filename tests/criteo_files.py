"""Criteo-format files for the reader's tests: hand-written lines, numbered lines, files of
uneven sizes, and what a reader read."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from paramserver.data import criteo
from paramserver.data.criteo import (
    NUM_CATEGORICAL,
    NUM_DENSE,
    CriteoFiles,
)


def criteo_line(label: str, ints: list[str], categorical: list[str]) -> str:
    ints = ints + [""] * (NUM_DENSE - len(ints))
    categorical = categorical + [""] * (NUM_CATEGORICAL - len(categorical))
    return "\t".join([label, *ints, *categorical])


HAND_LINES = [
    criteo_line("1", ["5", "", "-3", "0", "1000"], ["68fd1e64", "80e26c9b", "", "68fd1e64"]),
    criteo_line("0", ["0"] * NUM_DENSE, ["68fd1e64", "", "fb936136", "00000000"]),
    criteo_line("0", [], []),  # every feature missing
    criteo_line("1", ["123456789012", "-1", "7"], ["ABCDEF01", "1"]),
]


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "criteo-reader"]


def read_all(files: CriteoFiles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batches = list(files.train_batches(0, 1))
    return (
        torch.cat([dense for (dense, _), _ in batches]),
        torch.cat([sparse for (_, sparse), _ in batches]),
        torch.cat([label for _, label in batches]),
    )


def numbered_line(number: int) -> str:
    """A good line whose first integer feature is ``number`` (read back by line_numbers)."""
    return criteo_line("1", [str(number)], [f"{number:x}"])


def line_numbers(batches: Iterable[criteo.Batch]) -> list[int]:
    """The ``number`` of each numbered_line read, in order."""
    dense = [dense for (dense, _), _ in batches]
    if not dense:
        return []
    return torch.expm1(torch.cat(dense)[:, 0].double()).round().long().tolist()


def write_uneven_files(directory: Path) -> list[Path]:
    """Files of uneven sizes holding lines numbered 0, 1, ... in order: plain with empty
    lines, gzip, empty, CRLF endings, two lines without a final newline, and a larger one."""
    contents = [("a.txt", 537, "plain"), ("b.gz", 300, "gzip"), ("c.txt", 0, "plain")]
    contents += [("d.txt", 211, "crlf"), ("e.txt", 2, "no final newline")]
    contents += [("f.txt", 1000, "plain")]
    paths, number = [], 0
    for name, count, kind in contents:
        lines = [numbered_line(n) for n in range(number, number + count)]
        number += count
        path = directory / name
        paths.append(path)
        if kind == "gzip":
            path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
        elif kind == "crlf":
            path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
        elif kind == "no final newline":
            path.write_text("\n".join(lines))
        else:  # an empty line every 50 lines, and two at the end
            path.write_text(
                "".join(line + "\n" + "\n" * (i % 50 == 0) for i, line in enumerate(lines))
                + "\n" * 2 * bool(lines)
            )
    return paths
