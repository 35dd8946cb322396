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

:func:`divide` does that cutting for any pieces laid end to end (whole files, or ranges of them)
at any stream offsets: :func:`share_out` cuts them into ``T`` equal shares, :func:`hold_out`
into a first and a last part (a held-out fraction: the same rules, so a gzip file near that cut
goes whole to one side and the parts are cut at line starts).

:class:`ShareReader` reads one share, streamed (never a file whole), line by line
(:meth:`ShareReader.lines`) or a block of whole lines at a time (:meth:`ShareReader.blocks`,
read with a few large reads: the fast path), and counts the bytes it covers in
``input_bytes``. Line numbers are 1-based and count empty lines; a range's reader knows its
lines' positions relative to its first line start, and :meth:`SplitStart.line_number` turns
one into the file's line number by counting the newlines before that start only when asked
(for an error message), so the good path never reads another trainer's bytes. What a line
*means* is not decided here: a format's parser consumes the lines (see
:mod:`paramserver.data.criteo`).
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from gzip import BadGzipFile, GzipFile
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

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


def whole_files(paths: Sequence[Path]) -> list[InputSplit]:
    """Each non-empty file of ``paths`` whole, in order: the stream the splits cut."""
    sizes = [(path, path.stat().st_size) for path in paths]
    return [InputSplit(path, 0, size, is_gzip(path)) for path, size in sizes if size > 0]


def divide(pieces: Sequence[InputSplit], cuts: Sequence[int]) -> list[list[InputSplit]]:
    """The pieces laid end to end (a stream of their bytes), cut at the stream offsets ``cuts``
    (ascending, from 0 to the pieces' total): part ``t`` gets bytes ``[cuts[t], cuts[t + 1])``,
    a plain piece cut into ranges where a cut falls inside it, a gzip piece whole to the part
    holding its middle byte. Each part's pieces are in the stream's order."""
    parts: list[list[InputSplit]] = [[] for _ in range(len(cuts) - 1)]
    offset = 0
    for piece in pieces:
        size = piece.end - piece.start
        if piece.is_gzip:
            # The last part whose range starts at or before the middle byte: ranges can be
            # empty (fewer bytes than parts), and the one holding that byte is the last.
            owner = bisect.bisect_right(cuts, offset + size // 2) - 1
            parts[min(owner, len(parts) - 1)].append(piece)
        else:
            for t, part in enumerate(parts):
                start, end = max(cuts[t], offset), min(cuts[t + 1], offset + size)
                if start < end:
                    first = piece.start - offset
                    part.append(InputSplit(piece.path, first + start, first + end, False))
        offset += size
    return parts


def share_out(pieces: Sequence[InputSplit], num_trainers: int) -> list[list[InputSplit]]:
    """Every trainer's splits of the pieces (see the module docstring), in trainer order."""
    total = sum(piece.end - piece.start for piece in pieces)
    return divide(pieces, [total * t // num_trainers for t in range(num_trainers + 1)])


def hold_out(
    pieces: Sequence[InputSplit], fraction: float
) -> tuple[list[InputSplit], list[InputSplit]]:
    """The pieces cut in two: the first ``1 - fraction`` of their bytes and the last
    ``fraction``, at a line start (a gzip piece goes whole to the part holding its middle
    byte, so a part may be empty); a function of the pieces' sizes and kinds alone."""
    total = sum(piece.end - piece.start for piece in pieces)
    kept, held = divide(pieces, [0, total - round(total * fraction), total])
    return kept, held


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


class Block(NamedTuple):
    """Whole lines of a split read in one piece: ``data``, their bytes with their endings (a
    file's last line may have none), and where they are: their split's start and the index
    there of the first of them (1-based, empty lines counted)."""

    start: SplitStart
    first_index: int
    data: bytes

    def lines(self) -> Iterator[Line]:
        """Its non-empty lines without their endings, as :meth:`ShareReader.lines` reads them."""
        for index, line in enumerate(self.data.split(b"\n"), self.first_index):
            stripped = line.rstrip(b"\r\n")
            if stripped:
                yield self.start, index, stripped

    def next_index(self) -> int:
        """The index of the line after it in its split."""
        return self.first_index + int(np.count_nonzero(np.frombuffer(self.data, np.uint8) == 10))


class ShareReader:
    """Reads one trainer's splits, in order, as a stream of lines (:meth:`lines`) or of blocks
    of whole lines (:meth:`blocks`, the same lines a block at a time).

    ``input_bytes`` counts the bytes of the files the lines or blocks read so far cover: the
    lines of each plain range (with their endings, the line straddling its end included) and
    each gzip file's compressed bytes consumed. Over a whole pass it is the share's size, so
    the counts of all trainers add up to the files' size. Not thread-safe: one reader per
    iterator.
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

    def blocks(self, block_bytes: int) -> Iterator[Block]:
        """The splits' lines in blocks of about ``block_bytes`` (a block ends at a line end,
        so it is longer by the rest of its last line). Raises InvalidBatchError for a corrupt
        gzip stream, naming the file and the last line read before it."""
        for split in self.splits:
            with open(split.path, "rb") as raw:
                if split.is_gzip:
                    yield from self._gzip_blocks(split.path, raw, block_bytes)
                else:
                    yield from self._range_blocks(split, raw, block_bytes)

    def _range_blocks(self, split: InputSplit, raw: BinaryIO, block_bytes: int) -> Iterator[Block]:
        position = split.start
        if position > 0:  # skip the end of the line the previous range owns
            raw.seek(position - 1)
            position += len(raw.readline()) - 1
        start, index = SplitStart(split.path, position), 1
        while position < split.end:
            data = raw.read(min(block_bytes, split.end - position))
            if not data:
                return
            if not data.endswith(b"\n"):  # the rest of its last line, past the range's end too
                data += raw.readline()
            position += len(data)
            self.input_bytes += len(data)
            block = Block(start, index, data)
            index = block.next_index()
            yield block

    def _gzip_blocks(self, path: Path, raw: BinaryIO, block_bytes: int) -> Iterator[Block]:
        start, index, counted = SplitStart(path, 0), 1, 0
        try:
            stream = GzipFile(fileobj=raw, mode="rb")
            while data := stream.read(block_bytes):
                if not data.endswith(b"\n"):
                    data += stream.readline()
                self.input_bytes += raw.tell() - counted
                counted = raw.tell()
                block = Block(start, index, data)
                index = block.next_index()
                yield block
            self.input_bytes += raw.tell() - counted  # the stream's trailer
        except (EOFError, BadGzipFile, zlib.error) as e:
            raise InvalidBatchError(f"{path}: corrupt gzip data after line {index - 1}: {e}") from e

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
