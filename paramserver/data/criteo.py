"""Criteo click logs: a streaming reader, and a writer of synthetic files in the same format.

The format is that of the Criteo Display Advertising Challenge and of the Criteo Terabyte logs:
one example per line, 40 tab-separated fields.

- field 0, the label: ``0`` or ``1``;
- fields 1-13, integer features I1-I13: decimal integers of at most 18 digits, possibly negative,
  possibly empty (missing);
- fields 14-39, categorical features C1-C26: hex strings of 1 to 8 digits (the logs use exactly
  8), possibly empty (missing).

Lines may end in ``\\n`` or ``\\r\\n``; empty lines are skipped (they still count in line numbers).
A file is read as gzip when it starts with gzip's magic bytes, whatever its name, and as plain
text otherwise.

Batches are ``((dense, sparse), label)``, as in :mod:`paramserver.data.synthetic`:

- ``dense``: float32 ``[B, 13]``, each integer ``x`` mapped to ``log(1 + max(x, 0))`` (the usual
  Criteo transform: it tames the heavy tails and sends the few negative values to 0); missing
  values become 0, the same as ``x = 0``.
- ``sparse``: int64 ``[B, 26]``, one id per categorical column, for dynamic (hashed) tables such
  as :class:`paramserver.DynamicEmbedding`. Column ``c`` (0-based) turns the value ``v`` of its
  hex string into ``mix64(mix64(v) + seed_c)``, where ``seed_c = mix64(mix64(hash_salt) + c)``
  and ``mix64`` is SplitMix64's finalizer (:func:`paramserver.hashing.mix64`), all in
  wrapping int64 arithmetic. For a fixed column the map is a bijection of int64, so two values
  of a column never share an id; across columns equal strings get unrelated ids, spread over all
  of int64. A missing value is hashed as ``v = MISSING_VALUE = 2**32``, which no hex string of
  at most 8 digits reaches: each column has one fixed missing id, distinct from all its values.
- ``label``: float32 ``[B]``, 0.0 or 1.0.

Each trainer reads only its share of the files (:mod:`paramserver.data.splits`): plain-text
files are cut into byte ranges at line starts, gzip files go whole to one trainer, and the
shares balance bytes (as stored), not lines. Trainer ``t`` of ``T`` gets the ``t``-th of ``T``
consecutive stretches of the files' lines (in the order given) and cuts its own lines into
batches of ``batch_size``, its last batch possibly shorter. So every line is used exactly once
per pass, a trainer's batches do not depend on how fast the others read, and which lines share
a batch depends on ``T``: with one trainer, batch ``k`` holds the stream's non-empty lines
``k * batch_size`` to ``(k + 1) * batch_size - 1`` (counted from 0); with several, each
trainer's batches start afresh at its share's first line, and every trainer may end with a
short batch. A gzip file is read by one trainer alone: to spread it over several, split it or
decompress it. The iterator that :meth:`CriteoFiles.train_batches` returns counts, in
``input_bytes``, the bytes of the files behind the batches it has handed out (the job
summary's ``input_bytes``).

``eval_fraction`` holds out the last fraction of the input for evaluation
(:meth:`CriteoFiles.eval_batches`): the files laid end to end are cut at that fraction of
their bytes from the end, at a line start (a gzip file is never cut: it goes whole to the side
holding its middle byte), the trainers share the lines before the cut and the held-out part
is the lines after it. The cut is a function of the files' sizes alone, so every process
agrees on it, and like Criteo's own split (the last day held out) it holds out the latest
lines of time-ordered logs.

How a share is read, fast: a block of about ``BLOCK_BYTES`` of whole lines at a time
(:meth:`ShareReader.blocks <paramserver.data.splits.ShareReader.blocks>`), parsed in one go by
numpy operations on the whole block (:func:`paramserver.data.blockparse.parse_block`: no Python
work per line or per field), its categorical values hashed as array operations on whole
columns, its rows cut into batches. A background thread does all of that
(:class:`paramserver.data.readahead.ReadAhead`), up to ``READ_AHEAD_BLOCKS`` parsed blocks
ahead of the trainer, so reading overlaps training; it starts at the first ``next()`` and ends
with the pass, with ``close()``, or when the iterator is dropped. A file is never loaded whole:
a few blocks of it at most are in memory. The batches are those of the line-by-line reader
(:meth:`CriteoFiles.reference_batches`), tensor for tensor.

A malformed line (a wrong number of fields, a label other than 0/1, a non-integer in an integer
field, a non-hex categorical) and a corrupt gzip stream raise
:class:`paramserver.errors.InvalidBatchError`, naming the file, the line number (1-based, in
the whole file, whichever trainer reads it) and what was wrong; the batches before the one
holding the bad line are handed out first, as by the line-by-line reader, and the error is
raised in the trainer's thread by its ``next()``. A block the fast parse refuses is parsed
again line by line to find and name its first bad line (a block of good lines it leaves to the
slow path, such as one with a line ending ``\\r\\r\\n``, is read that way). A corrupt gzip
stream is found a block at a time: the error names the last line of the blocks read before it.
Only the trainer whose share holds a line parses it, so that trainer is the one that raises.

:func:`write_synthetic_criteo` writes files in this format with a planted signal, for tests and
demos.
"""

from __future__ import annotations

import functools
import logging
import re
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass
from gzip import GzipFile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from paramserver.data.blockparse import keep_freed_memory, parse_block
from paramserver.data.readahead import ReadAhead
from paramserver.data.splits import (
    Block,
    InputSplit,
    Line,
    ShareReader,
    hold_out,
    share_out,
    whole_files,
)
from paramserver.errors import ConfigError, InvalidBatchError
from paramserver.hashing import mix64, mix64_in_place

log = logging.getLogger(__name__)

Batch = tuple[tuple[Tensor, Tensor], Tensor]
NUM_DENSE = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
MISSING_VALUE = 1 << 32  # hashed in place of a missing categorical: no 8-digit hex reaches it
BLOCK_BYTES = 1 << 20  # parsed in one go: lines enough to amortise the calls, few MiB of arrays
READ_AHEAD_BLOCKS = 2  # parsed blocks waiting for the trainer

_INT = rb"-?[0-9]{1,18}"  # 18 digits always fit in int64
_HEX = rb"[0-9a-fA-F]{1,8}"
_LINE = re.compile(
    rb"[01]"
    + (rb"\t(?:" + _INT + rb")?") * NUM_DENSE
    + (rb"\t(?:" + _HEX + rb")?") * NUM_CATEGORICAL
)
_INT_FIELD = re.compile(_INT)
_HEX_FIELD = re.compile(_HEX)


@dataclass(frozen=True)
class CriteoFiles:
    """Criteo-format files, each trainer's share read as batches (see the module docstring).

    ``hash_salt`` changes every categorical id (for example to decorrelate two models' tables).
    ``eval_fraction`` (in [0, 1)) holds out the last fraction of the files' bytes, cut at a
    line start, for :meth:`eval_batches`; the trainers share the rest. Reading is stateless:
    each call of :meth:`train_batches` opens the files afresh, so any number of iterators (one
    per trainer thread, say) may run at once.
    """

    paths: Sequence[str | Path]
    batch_size: int = 512
    _: KW_ONLY
    hash_salt: int = 0
    eval_fraction: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(self.paths))
        if not self.paths:
            raise ConfigError("CriteoFiles.paths: give at least one file")
        if self.batch_size < 1:
            raise ConfigError(f"CriteoFiles.batch_size must be at least 1, got {self.batch_size}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(
                f"CriteoFiles.eval_fraction must be in [0, 1), got {self.eval_fraction}"
            )

    def splits(self, trainer: int, num_trainers: int) -> list[InputSplit]:
        """The parts of the files trainer ``trainer`` of ``num_trainers`` reads."""
        if num_trainers < 1 or not 0 <= trainer < num_trainers:
            raise ConfigError(
                f"trainer must be in [0, num_trainers); got trainer={trainer}, "
                f"num_trainers={num_trainers}"
            )
        return share_out(self._parts()[0], num_trainers)[trainer]

    def eval_splits(self) -> list[InputSplit]:
        """The held-out parts of the files (none without ``eval_fraction``)."""
        return self._parts()[1]

    def _parts(self) -> tuple[list[InputSplit], list[InputSplit]]:
        """The files cut in two: what the trainers share, and what is held out."""
        files = whole_files([Path(p) for p in self.paths])
        return hold_out(files, self.eval_fraction) if self.eval_fraction else (files, [])

    def train_batches(self, trainer: int, num_trainers: int) -> CriteoBatches:
        """One pass over this trainer's share, in batches, the last one possibly short.
        Raises InvalidBatchError on a malformed line of the share."""
        splits = self.splits(trainer, num_trainers)
        if not splits:
            _warn_no_input(trainer, num_trainers)
        return CriteoBatches(self, splits)

    def eval_batches(self) -> CriteoBatches:
        """One pass over the held-out lines (``eval_fraction``), in batches."""
        return CriteoBatches(self, self.eval_splits())

    def reference_batches(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        """The same batches as :meth:`train_batches`, read line by line in this thread, with
        a regular expression and ``int()`` per field: the slow reader the fast one is tested
        and benchmarked against."""
        batch: list[Line] = []
        for line in ShareReader(self.splits(trainer, num_trainers)).lines():
            batch.append(line)
            if len(batch) == self.batch_size:
                yield _parse_lines(batch, self.hash_salt)
                batch = []
        if batch:
            yield _parse_lines(batch, self.hash_salt)


class CriteoBatches(Iterator[Batch]):
    """One pass over some splits of :class:`CriteoFiles`, in batches, read ahead by a thread
    (see :meth:`CriteoFiles.train_batches` and the module docstring).

    ``input_bytes`` is the bytes of the files behind the batches handed out so far (a block's
    bytes count from its first batch): over a whole pass, the splits' size. ``close()`` stops
    the reading thread and closes the file being read; dropping the iterator does the same.
    A batch's tensors are the caller's: views of its block's rows, which no other block
    shares. One consumer at a time.
    """

    def __init__(self, files: CriteoFiles, splits: Sequence[InputSplit]):
        # The thread's work holds no reference to this iterator: dropping it ends the thread.
        self._produce = functools.partial(_share_batches, files, ShareReader(splits))
        self._read_ahead: ReadAhead[tuple[list[Batch], int]] | None = None
        self._ready: deque[Batch] = deque()
        self._closed = False
        self.input_bytes = 0

    def __next__(self) -> Batch:
        while not self._ready:
            if self._closed:
                raise StopIteration
            if self._read_ahead is None:
                keep_freed_memory()
                self._read_ahead = ReadAhead(self._produce, READ_AHEAD_BLOCKS, "criteo-reader")
            batches, self.input_bytes = next(self._read_ahead)
            self._ready.extend(batches)
        return self._ready.popleft()

    def close(self) -> None:
        self._closed = True
        self._ready.clear()
        if self._read_ahead is not None:
            self._read_ahead.close()


class _Rows(NamedTuple):
    """Parsed lines: dense features ``[n, 13]``, categorical ids ``[n, 26]``, labels ``[n]``."""

    dense: Tensor
    sparse: Tensor
    labels: Tensor

    def batch(self, start: int, end: int) -> Batch:
        """Rows ``[start, end)`` as a batch: contiguous views of these rows' tensors (a block's
        own, shared with no other block)."""
        return (self.dense[start:end], self.sparse[start:end]), self.labels[start:end]


def share_rows(splits: Sequence[InputSplit], hash_salt: int = 0) -> Iterator[Batch]:
    """A share's lines parsed a block at a time: each block's rows as one batch, in order. A
    malformed line raises InvalidBatchError (naming it) after the rows before it."""
    for block in ShareReader(splits).blocks(BLOCK_BYTES):
        rows, error = _parse_block(block, hash_salt)
        if len(rows.labels):
            yield rows.batch(0, len(rows.labels))
        if error is not None:
            raise error


def _share_batches(files: CriteoFiles, reader: ShareReader) -> Iterator[tuple[list[Batch], int]]:
    """The reading thread's work: the batches each block completes, with the bytes read by
    then. A block with a bad line completes the batches before that line's, then raises."""
    cutter = _BatchCutter(files.batch_size)
    for block in reader.blocks(BLOCK_BYTES):
        rows, error = _parse_block(block, files.hash_salt)
        yield cutter.add(rows), reader.input_bytes
        if error is not None:
            raise error
    yield cutter.finish(), reader.input_bytes


class _BatchCutter:
    """Cuts a stream of rows, given a block at a time, into batches of ``batch_size``."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.rest: _Rows | None = None  # the start of the next batch

    def add(self, rows: _Rows) -> list[Batch]:
        batches, start, size = [], 0, len(rows.labels)
        if self.rest is not None:
            start = min(self.batch_size - len(self.rest.labels), size)
            head = _Rows(*(torch.cat([a, b[:start]]) for a, b in zip(self.rest, rows, strict=True)))
            self.rest = None
            if len(head.labels) < self.batch_size:
                self.rest = head
                return []
            batches.append(head.batch(0, self.batch_size))
        end = start + (size - start) // self.batch_size * self.batch_size
        batches += [rows.batch(i, i + self.batch_size) for i in range(start, end, self.batch_size)]
        if end < size:
            self.rest = _Rows(*(t[end:] for t in rows))
        return batches

    def finish(self) -> list[Batch]:
        """The last batch, short, if rows are left."""
        rest, self.rest = self.rest, None
        return [] if rest is None else [rest.batch(0, len(rest.labels))]


def _parse_block(block: Block, hash_salt: int) -> tuple[_Rows, InvalidBatchError | None]:
    """A block's rows, parsed in one call; where that fails, line by line: the rows before its
    first bad line, and the error naming that line (None if every line is good)."""
    columns = parse_block(block.data, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE)
    if columns is None:
        return _parse_until_bad(block, hash_salt)
    return _Rows(
        transform_dense(torch.from_numpy(columns.ints)),
        torch.from_numpy(_hash_columns(columns.hex_values, hash_salt)),
        torch.from_numpy(columns.labels),
    ), None


def _parse_until_bad(block: Block, hash_salt: int) -> tuple[_Rows, InvalidBatchError | None]:
    """A block's lines parsed one by one: the rows up to its first bad line, and that line's
    error (None if there is none)."""
    good: list[Line] = []
    error = None
    for line in block.lines():
        if _LINE.fullmatch(line[2]) is None:
            error = _bad_line(line)
            break
        good.append(line)
    (dense, sparse), labels = _parse_lines(good, hash_salt)
    return _Rows(dense, sparse, labels), error


def _parse_lines(lines: list[Line], hash_salt: int) -> Batch:
    """The tensors of lines, parsed one by one; InvalidBatchError names a malformed one."""
    for line in lines:
        if _LINE.fullmatch(line[2]) is None:
            raise _bad_line(line)
    return _parse_texts([line[2] for line in lines], hash_salt)


def _parse_texts(texts: Sequence[bytes], hash_salt: int) -> Batch:
    """The tensors of well-formed lines, parsed one by one."""
    labels: list[bool] = []
    dense: list[list[int]] = []
    categorical: list[list[int]] = []
    for text in texts:
        fields = text.removesuffix(b"\r").split(b"\t")
        labels.append(fields[0] == b"1")
        dense.append([int(x) if x else 0 for x in fields[1 : 1 + NUM_DENSE]])
        categorical.append([int(x, 16) if x else MISSING_VALUE for x in fields[1 + NUM_DENSE :]])
    values = torch.tensor(categorical, dtype=torch.int64).reshape(-1, NUM_CATEGORICAL)
    return (
        (
            transform_dense(torch.tensor(dense, dtype=torch.int64).reshape(-1, NUM_DENSE)),
            hash_categorical(values, hash_salt),
        ),
        torch.tensor(labels, dtype=torch.float32),
    )


def decode_records(records: Sequence[bytes], hash_salt: int = 0) -> tuple[Batch, list[str | None]]:
    """Records of a stream, each one Criteo line (without its ending), as one batch of the
    good ones, and for each record why it is bad (None: good). The fast block parse takes
    them all in one go where every record is good; otherwise each is checked alone, and the
    good ones parsed together."""
    joined = b"\n".join(records)
    bad: list[str | None] = [None] * len(records)
    columns = parse_block(joined, NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE) if records else None
    if columns is None or len(columns.labels) != len(records):  # empty lines join too
        for i, record in enumerate(records):
            if b"\n" in record or _LINE.fullmatch(record.removesuffix(b"\r")) is None:
                bad[i] = "a line break inside" if b"\n" in record else _diagnose(record)
        good = [r for r, why in zip(records, bad, strict=True) if why is None]
        columns = parse_block(b"\n".join(good), NUM_DENSE, NUM_CATEGORICAL, MISSING_VALUE)
        if columns is None:  # lines only the slow parse takes (see blockparse)
            return _parse_texts(good, hash_salt), bad
    rows = _Rows(
        transform_dense(torch.from_numpy(columns.ints)),
        torch.from_numpy(_hash_columns(columns.hex_values, hash_salt)),
        torch.from_numpy(columns.labels),
    )
    return rows.batch(0, len(rows.labels)), bad


def _bad_line(line: Line) -> InvalidBatchError:
    start, index, text = line
    return InvalidBatchError(f"{start.path}, line {start.line_number(index)}: {_diagnose(text)}")


@functools.cache  # once per process, not every epoch
def _warn_no_input(trainer: int, num_trainers: int) -> None:
    log.warning(
        "criteo: trainer %d of %d has no input (a gzip file is read whole by one trainer; "
        "give more files, or plain text, to keep every trainer busy)",
        trainer,
        num_trainers,
    )


def transform_dense(values: Tensor) -> Tensor:
    """``log(1 + max(x, 0))`` of int64 features (missing ones given as 0), as float32."""
    return values.clamp(min=0).double().log1p().float()


def hash_categorical(values: Tensor, hash_salt: int = 0) -> Tensor:
    """Ids of int64 categorical values ``[B, 26]`` (``MISSING_VALUE`` where missing): column
    ``c``'s value ``v`` becomes ``mix64(mix64(v) + seed_c)``, ``seed_c = mix64(mix64(salt) + c)``.
    """
    return mix64(mix64(values.reshape(-1, NUM_CATEGORICAL)) + _column_seeds(hash_salt))


def _column_seeds(hash_salt: int) -> Tensor:
    """``seed_c`` of every column ``c`` (see :func:`hash_categorical`), int64 ``[26]``."""
    salt = torch.tensor([(hash_salt + 2**63) % 2**64 - 2**63], dtype=torch.int64)
    return mix64(mix64(salt) + torch.arange(NUM_CATEGORICAL, dtype=torch.int64))


def _hash_columns(values: np.ndarray, hash_salt: int) -> np.ndarray:
    """:func:`hash_categorical` of uint64 values ``[n, 26]``, computed in place on the whole
    array: int64 ``[n, 26]``, the same memory."""
    scratch = np.empty_like(values)
    mix64_in_place(values, scratch)
    values += _column_seeds(hash_salt).numpy().view(np.uint64)
    mix64_in_place(values, scratch)
    return values.view(np.int64)


def _diagnose(line: bytes) -> str:
    """What is wrong with a line that failed the format's pattern."""
    fields = line.split(b"\t")
    if len(fields) != NUM_FIELDS:
        return f"expected {NUM_FIELDS} tab-separated fields, found {len(fields)}"
    if fields[0] not in (b"0", b"1"):
        return f"the label (field 0) must be 0 or 1, found {_show(fields[0])}"
    for i in range(1, 1 + NUM_DENSE):
        if fields[i] and _INT_FIELD.fullmatch(fields[i]) is None:
            return (
                f"integer feature I{i} (field {i}) must be an integer of at most 18 digits, "
                f"found {_show(fields[i])}"
            )
    for i in range(1 + NUM_DENSE, NUM_FIELDS):
        if fields[i] and _HEX_FIELD.fullmatch(fields[i]) is None:
            return (
                f"categorical feature C{i - NUM_DENSE} (field {i}) must be 1 to 8 hex digits, "
                f"found {_show(fields[i])}"
            )
    return "malformed line"


def _show(field: bytes) -> str:
    return repr(field[:40].decode("ascii", "backslashreplace"))


# ---- synthetic files with a planted signal ----

SIGNAL_DENSE = (0, 1, 2)  # dense features the labels depend on
SIGNAL_DENSE_WEIGHTS = (0.8, -0.7, 0.6)  # their weights on the transformed feature
SIGNAL_CATEGORICAL = (0, 1, 2)  # categorical columns whose values carry an effect on the logit
SIGNAL_VOCABULARY = 50  # distinct values in each signal column (others: NOISE_VOCABULARY)
NOISE_VOCABULARY = 5000
MISSING_DENSE_RATE = 0.1
MISSING_CATEGORICAL_RATE = 0.05
_CHUNK_LINES = 8192
_LINES_SEED_OFFSET = 1 << 32  # the lines' generator is never seeded as the signal's (seeds < 2**32)


def write_synthetic_criteo(
    path: str | Path, lines: int, *, seed: int = 0, signal_seed: int = 0, gzip: bool = False
) -> None:
    """Write ``lines`` Criteo-format lines to ``path`` (gzip-compressed if ``gzip``).

    The labels follow a logistic model, the planted signal, drawn from ``signal_seed``: the
    logit is ``-1`` plus ``SIGNAL_DENSE_WEIGHTS`` times the transformed features
    ``SIGNAL_DENSE`` (centred at 1), plus a per-value effect, drawn from N(0, 1), of each of
    the columns ``SIGNAL_CATEGORICAL``; the label is a Bernoulli draw of its sigmoid.
    Categorical values are log-uniform ranks in a fixed per-column vocabulary of random 8-digit
    hex strings, also drawn from ``signal_seed``. The lines are drawn from ``seed``: integer
    features are ``floor(exp(1.5 z + 0.5)) - 1`` for standard normal ``z`` (so some are -1);
    about ``MISSING_DENSE_RATE`` of the integer fields and ``MISSING_CATEGORICAL_RATE`` of the
    categorical ones are empty; a missing value has no effect on the logit beyond its
    transformed value of 0. So files written with the same ``signal_seed`` (the default) and
    other ``seed`` values are samples of one distribution: training and held-out data. The
    two draws use separate generators (the lines' seeded with ``seed + 2**32``), and the
    file's bytes are a function of ``seed``, ``signal_seed`` and ``lines`` (the gzip header's
    timestamp is fixed to 0).
    """
    with open(path, "wb") as raw:
        out = GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) if gzip else raw
        for chunk in synthetic_criteo_chunks(lines, seed=seed, signal_seed=signal_seed):
            out.write(chunk)
        if out is not raw:
            out.close()


def synthetic_criteo_chunks(
    lines: int | None, *, seed: int = 0, signal_seed: int = 0
) -> Iterator[bytes]:
    """The lines :func:`write_synthetic_criteo` writes, a few thousand at a time (each chunk
    whole lines, each ending in a newline); ``lines`` None: without end."""
    vocabularies = _draw_vocabularies(torch.Generator().manual_seed(signal_seed))
    g = torch.Generator().manual_seed(seed + _LINES_SEED_OFFSET)
    start = 0
    while lines is None or start < lines:
        count = _CHUNK_LINES if lines is None else min(_CHUNK_LINES, lines - start)
        yield _synthetic_lines(count, vocabularies, g)
        start += count


@dataclass(frozen=True)
class _Vocabularies:
    """The synthetic files' categorical values: per column, its vocabulary of 8-digit hex
    strings, and for each column of ``SIGNAL_CATEGORICAL``, each value's effect on the logit."""

    values: list[list[str]]
    effects: dict[int, Tensor]


def _draw_vocabularies(g: torch.Generator) -> _Vocabularies:
    sizes = [
        SIGNAL_VOCABULARY if c in SIGNAL_CATEGORICAL else NOISE_VOCABULARY
        for c in range(NUM_CATEGORICAL)
    ]
    values = [
        [f"{v:08x}" for v in torch.randint(0, 1 << 32, (size,), generator=g).tolist()]
        for size in sizes
    ]
    effects = {c: torch.randn(sizes[c], generator=g) for c in SIGNAL_CATEGORICAL}
    return _Vocabularies(values, effects)


def _synthetic_lines(n: int, vocabularies: _Vocabularies, g: torch.Generator) -> bytes:
    """``n`` lines: features drawn from ``g``, labels from the planted model."""
    ints = torch.exp(1.5 * torch.randn(n, NUM_DENSE, generator=g) + 0.5).floor().long() - 1
    dense_missing = torch.rand(n, NUM_DENSE, generator=g) < MISSING_DENSE_RATE
    u = torch.rand(n, NUM_CATEGORICAL, generator=g)
    sizes = torch.tensor([len(v) for v in vocabularies.values], dtype=torch.float64)
    ranks = (sizes ** u.double()).floor().long() - 1  # log-uniform in each vocabulary
    categorical_missing = torch.rand(n, NUM_CATEGORICAL, generator=g) < MISSING_CATEGORICAL_RATE
    logits = _planted_logits(
        ints.masked_fill(dense_missing, 0),
        ranks,
        categorical_missing,
        vocabularies.effects,
    )
    labels = torch.bernoulli(torch.sigmoid(logits), generator=g).long()
    columns = [[str(x) for x in labels.tolist()]]
    for j in range(NUM_DENSE):
        column = zip(ints[:, j].tolist(), dense_missing[:, j].tolist(), strict=True)
        columns.append(["" if missing else str(x) for x, missing in column])
    for c in range(NUM_CATEGORICAL):
        values = vocabularies.values[c]
        column = zip(ranks[:, c].tolist(), categorical_missing[:, c].tolist(), strict=True)
        columns.append(["" if missing else values[r] for r, missing in column])
    return "".join("\t".join(fields) + "\n" for fields in zip(*columns, strict=True)).encode()


def _planted_logits(
    ints: Tensor, ranks: Tensor, categorical_missing: Tensor, effects: dict[int, Tensor]
) -> Tensor:
    """The logistic model's logit of each line (see :func:`write_synthetic_criteo`), from its
    integer features (0 where missing) and categorical ranks."""
    features = transform_dense(ints)
    logits = -1.0 + (features[:, list(SIGNAL_DENSE)] - 1.0) @ torch.tensor(SIGNAL_DENSE_WEIGHTS)
    for c in SIGNAL_CATEGORICAL:
        effect = effects[c][ranks[:, c]].masked_fill(categorical_missing[:, c], 0.0)
        logits = logits + effect
    return logits
