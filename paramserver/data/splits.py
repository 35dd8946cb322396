"""Input splits: each trainer's share of a list of line-oriented files, and how it is read.

The files, in the order given, are laid end to end as one stream of ``total`` bytes (as stored:
a gzip file counts its compressed size), and trainer ``t`` of ``T`` gets the bytes
``[t * total // T, (t + 1) * total // T)`` of it:

- A plain-text file is cut into byte ranges, one per trainer whose bytes it overlaps. As in
  Hadoop's and Spark's readers, a range ``[start, end)`` owns the lines that *start* in it: a
  reader whose range starts mid-line skips to the next line start, and the line straddling
  ``end`` is read whole by the range where it starts. So every line belongs to exactly one range
  and a trainer reads only its own bytes (plus the end of the one line it skips).
- A gzip file (detected by its magic bytes) cannot be entered mid-stream: it goes whole to the
  trainer whose bytes hold its middle byte.
- An empty file goes to no one.

The assignment is a function of the files' sizes, kinds and order and of ``T`` alone, so every
trainer computes it on its own and all agree. Each share is one stretch of the stream: trainer
``t``'s lines come after trainer ``t - 1``'s, and the shares laid end to end are the files'
lines in order. A trainer's bytes are ``total / T`` give or take one line per plain cut, and
at most the largest gzip file's size where gzip files sit at the cuts. Bytes are balanced,
not lines: a gzip file holds several times the lines of plain text of its size.

:class:`ShareReader` reads one share line by line, streamed (never a file whole), and counts
the bytes it covers in ``input_bytes``. Line numbers are 1-based and count empty lines; a
range's reader knows its lines' positions relative to its first line start, and
:meth:`SplitStart.line_number` turns one into the file's line number by counting the newlines
before that start only when asked (for an error message), so the good path never reads
another trainer's bytes. What a line *means* is not decided here: a format's parser consumes
the lines (see :mod:`paramserver.data.criteo`).
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from gzip import BadGzipFile, GzipFile
from pathlib import Path
from typing import BinaryIO

from paramserver.errors import InvalidBatchError

GZIP_MAGIC = b"\x1f\x8b"
_COUNT_BLOCK_BYTES = 1 << 20  # newlines are counted a block at a time, never a file whole


@dataclass(frozen=True)
class InputSplit:
    """Bytes ``[start, end)`` of ``path`` (as stored); a gzip split is always the whole file."""

    path: Path
    start: int
    end: int
    is_gzip: bool


def is_gzip(path: Path) -> bool:
    """Whether ``path`` starts with gzip's magic bytes (whatever its name)."""
    with open(path, "rb", buffering=0) as raw:  # unbuffered: reads these 2 bytes, no more
        return raw.read(len(GZIP_MAGIC)) == GZIP_MAGIC


def plan_splits(paths: Sequence[Path], num_trainers: int) -> list[list[InputSplit]]:
    """Every trainer's splits (see the module docstring), in trainer order, each share's
    splits in the files' order."""
    files = [(path, path.stat().st_size) for path in paths]
    total = sum(size for _, size in files)
    cuts = [total * t // num_trainers for t in range(num_trainers + 1)]
    shares: list[list[InputSplit]] = [[] for _ in range(num_trainers)]
    offset = 0
    for path, size in files:
        if size == 0:
            continue
        if is_gzip(path):
            # The last trainer whose range starts at or before the middle byte: ranges can be
            # empty (fewer bytes than trainers), and the one holding that byte is the last.
            owner = bisect.bisect_right(cuts, offset + size // 2) - 1
            shares[min(owner, num_trainers - 1)].append(InputSplit(path, 0, size, True))
        else:
            for t, share in enumerate(shares):
                start, end = max(cuts[t], offset), min(cuts[t + 1], offset + size)
                if start < end:
                    share.append(InputSplit(path, start - offset, end - offset, False))
        offset += size
    return shares


@dataclass(frozen=True)
class SplitStart:
    """Where a split's first line starts in its file; its lines are numbered from there."""

    path: Path
    offset: int  # a line start: 0, or just after a b"\n" of a plain file

    def line_number(self, index: int) -> int:
        """The file's 1-based line number of the split's ``index``-th line (1-based)."""
        if self.offset == 0:
            return index
        newlines = 0
        with open(self.path, "rb") as raw:
            remaining = self.offset
            while remaining > 0:
                block = raw.read(min(_COUNT_BLOCK_BYTES, remaining))
                newlines += block.count(b"\n")
                remaining -= len(block)
        return newlines + index


Line = tuple[SplitStart, int, bytes]
"""A non-empty line without its ending, and where it is: its split's start and its index
there (1-based, empty lines counted)."""


class ShareReader:
    """Reads one trainer's splits, in order, as a stream of lines.

    ``input_bytes`` counts the bytes of the files the lines read so far cover: the lines of
    each plain range (with their endings, the line straddling its end included) and each gzip
    file's compressed bytes consumed. Over a whole pass it is the share's size, so the counts
    of all trainers add up to the files' size. Not thread-safe: one reader per iterator.
    """

    def __init__(self, splits: Sequence[InputSplit]):
        self.splits = tuple(splits)
        self.input_bytes = 0

    def lines(self) -> Iterator[Line]:
        """Every non-empty line of the splits, without its line ending (``\\n`` or ``\\r\\n``).
        Raises InvalidBatchError for a corrupt gzip stream, naming the file."""
        for split in self.splits:
            with open(split.path, "rb") as raw:
                if split.is_gzip:
                    yield from self._gzip_lines(split.path, raw)
                else:
                    yield from self._range_lines(split, raw)

    def _range_lines(self, split: InputSplit, raw: BinaryIO) -> Iterator[Line]:
        position = split.start
        if position > 0:  # skip the end of the line the previous range owns
            raw.seek(position - 1)
            position += len(raw.readline()) - 1
        start = SplitStart(split.path, position)
        index = 0
        while position < split.end:
            line = raw.readline()
            if not line:
                return
            index += 1
            position += len(line)
            self.input_bytes += len(line)
            line = line.rstrip(b"\r\n")
            if line:
                yield start, index, line

    def _gzip_lines(self, path: Path, raw: BinaryIO) -> Iterator[Line]:
        start = SplitStart(path, 0)
        index = counted = 0
        try:
            for index, line in enumerate(GzipFile(fileobj=raw, mode="rb"), 1):
                consumed = raw.tell()
                self.input_bytes += consumed - counted
                counted = consumed
                stripped = line.rstrip(b"\r\n")
                if stripped:
                    yield start, index, stripped
            self.input_bytes += raw.tell() - counted  # the stream's trailer
        except (EOFError, BadGzipFile, zlib.error) as e:
            raise InvalidBatchError(f"{path}: corrupt gzip data after line {index}: {e}") from e
