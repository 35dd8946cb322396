"""Records of a stream into batches: decoded a chunk at a time, bad ones counted and skipped,
cut into batches of ``batch_size`` that each know where in the stream they end.

A *decoder* takes a chunk of records (their raw bytes) and returns the good ones as one batch
(``((dense, sparse), label)`` or any tuple or list of tensors whose first dimension counts the
good records) and, for every record, why it is bad (None: good): see
:func:`paramserver.data.criteo.decode_records`, the default for Criteo lines.

A bad record is logged and skipped, up to ``max_bad_records`` in a job; one more stops the job
with an :class:`~paramserver.errors.InvalidBatchError` naming it (one malformed event does not
stop a production job, a broken producer does). Batches are cut by count, never by time, so a
resume that reads the same records again cuts the same batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from paramserver.data.readahead import ReadAhead
from paramserver.errors import InvalidBatchError

log = logging.getLogger(__name__)

Decoder = Callable[[Sequence[bytes]], tuple[Any, list[str | None]]]
"""``decode(records) -> (batch of the good ones, why each record is bad or None)``."""

DEFAULT_MAX_BAD_RECORDS = 10


class RecordBatcher:
    """Cuts decoded records into batches; each batch comes with its position (JSON): the id of
    its last record, and the good and bad records up to it (since the job began). Not
    thread-safe."""

    def __init__(
        self, decode: Decoder | None, batch_size: int, max_bad_records: int, source: str
    ) -> None:
        self.decode = decode  # None: rows come decoded (add_rows only)
        self.batch_size = batch_size
        self.max_bad_records = max_bad_records
        self.source = source  # names the stream in messages
        self.records = 0  # good records cut into batches
        self.bad_records = 0
        self._rest: Any = None  # rows waiting for a full batch
        self._rest_ids: list[Any] = []
        self._rest_bad: list[int] = []  # for each, the bad records counted by then

    def resume(self, position: dict[str, Any]) -> None:
        """Go on counting from a saved position."""
        self.records = int(position.get("records", 0))
        self.bad_records = int(position.get("bad_records", 0))

    def add(self, ids: Sequence[Any], values: Sequence[bytes | None]) -> list[tuple[Any, dict]]:
        """The batches that records ``values`` (with their ids; None: a record without the
        field read) complete, each with its position."""
        assert self.decode is not None, "records need a decoder"
        present = [v for v in values if v is not None]
        rows, judged = self.decode(present) if present else (None, [])
        if len(judged) != len(present):
            raise InvalidBatchError(
                f"{self.source}: the decoder judged {len(judged)} records of {len(present)}"
            )
        if len(present) == len(values) and not any(judged):  # all good: the common case
            good_ids, bad_by_then = list(ids), [self.bad_records] * len(ids)
        else:
            good_ids, bad_by_then = self._sorted_out(ids, values, judged)
        if good_ids and _rows_of(rows) != len(good_ids):
            raise InvalidBatchError(
                f"{self.source}: the decoder gave {_rows_of(rows)} rows for {len(good_ids)} "
                f"good records"
            )
        return self.add_rows(rows, good_ids, bad_by_then) if good_ids else []

    def _sorted_out(
        self, ids: Sequence[Any], values: Sequence[bytes | None], judged: list[str | None]
    ) -> tuple[list[Any], list[int]]:
        """The good records' ids, and the bad records counted by each; the bad ones skipped."""
        verdicts = iter(judged)
        missing = "the entry has no such field, or was deleted"
        good_ids, bad_by_then = [], []
        for record_id, value in zip(ids, values, strict=True):
            why = missing if value is None else next(verdicts)
            if why is not None:
                self._skip(_text(record_id), why)
            else:
                good_ids.append(record_id)
                bad_by_then.append(self.bad_records)
        return good_ids, bad_by_then

    def add_rows(self, rows: Any, ids: list[Any], bad: list[int]) -> list[tuple[Any, dict]]:
        """The batches that decoded ``rows`` complete; ``ids``: each row's id (JSON), ``bad``:
        the bad records counted by each row."""
        if self._rest is not None:
            rows, ids, bad = _cat([self._rest, rows]), self._rest_ids + ids, self._rest_bad + bad
        size, batches = len(ids), []
        end = size - size % self.batch_size
        for start in range(0, end, self.batch_size):
            self.records += self.batch_size
            last = start + self.batch_size - 1
            position = {"id": _text(ids[last]), "records": self.records, "bad_records": bad[last]}
            batches.append((_slice(rows, start, start + self.batch_size), position))
        self._rest = _slice(rows, end, size) if end < size else None
        self._rest_ids, self._rest_bad = ids[end:], bad[end:]
        return batches

    def _skip(self, record_id: str, why: str) -> None:
        self.bad_records += 1
        if self.bad_records > self.max_bad_records:
            raise InvalidBatchError(
                f"{self.source}: more than {self.max_bad_records} bad records "
                f"(--max-bad-records); the last, {record_id}: {why}"
            )
        log.warning("%s: record %s skipped: %s", self.source, record_id, why)


Chunk = list[tuple[Any, dict]]  # batches, each with its position


class ChunkedReader(Iterator[Any]):
    """A stream reader's trainer side: ``_chunks()`` (the subclass's) runs in a reading thread,
    ``READ_AHEAD`` chunks ahead, each chunk the batches one read completed (an empty one: the
    read waited and found nothing new, and ``on_idle`` is called: waiting for records is not
    being stuck). ``position()`` is the last batch handed out's. One consumer thread."""

    READ_AHEAD = 4

    def __init__(self, thread_name: str):
        self.thread_name = thread_name
        self.on_idle: Callable[[], None] | None = None  # the trainer's activity
        self._position: dict[str, Any] | None = None
        self._read_ahead: ReadAhead[Chunk] | None = None
        self._ready: Chunk = []

    def position(self) -> dict[str, Any] | None:
        return self._position

    def __next__(self) -> Any:
        while not self._ready:
            if self._read_ahead is None:
                self._read_ahead = ReadAhead(self._chunks, self.READ_AHEAD, self.thread_name)
            chunk = next(self._read_ahead)
            if not chunk and self.on_idle is not None:
                self.on_idle()
            self._ready = chunk[::-1]
        batch, self._position = self._ready.pop()
        return batch

    def close(self) -> None:
        if self._read_ahead is not None:
            self._read_ahead.close()

    def _started(self) -> bool:
        return self._read_ahead is not None

    def _chunks(self) -> Iterator[Chunk]:
        raise NotImplementedError


def _text(record_id: Any) -> Any:
    """A record's id as JSON: a stream's entry ids come as bytes."""
    return record_id.decode() if isinstance(record_id, bytes) else record_id


def _rows_of(rows: Any) -> int:
    if isinstance(rows, Tensor):
        return int(rows.shape[0])
    return _rows_of(rows[0])


def _slice(rows: Any, start: int, end: int) -> Any:
    if isinstance(rows, Tensor):
        return rows[start:end]
    return type(rows)(_slice(part, start, end) for part in rows)


def _cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return type(parts[0])(_cat(list(each)) for each in zip(*parts, strict=True))
