"""Training input from a Redis stream, through a consumer group (``--dataset
stream:redis://HOST:PORT/STREAM``).

Every trainer is one consumer of the group (``trainer-T``): Redis hands each new entry to one
of them (``XREADGROUP ... >``), so the trainers share the stream without splitting it
beforehand, and keeps every entry it handed out in that consumer's pending list until it is
acknowledged (``XACK``). An entry's field ``line`` (by default) holds one record, a Criteo
line for the command line's job (:func:`paramserver.data.criteo.decode_records`); the Python API
takes any decoder (:mod:`paramserver.streams.batching`).

Exactly once, with checkpoints (see :mod:`paramserver.inputs`):

- the position a trainer saves is the id of the last entry of its last step trained;
- entries are acknowledged only once a committed checkpoint holds them: a trainer's, when it
  next saves a part; the final checkpoint's, by the chief right after it commits it
  (:meth:`RedisStreamReader.acknowledge_every_trainer`, every trainer's consumer, within a
  bound: where Redis does not answer by then, they stay pending for the resume);
- a trainer that starts (afresh or resumed) first reads its own pending entries after its
  saved position (``XREADGROUP ... ID``: what it had been handed but the model does not hold,
  read ahead and not trained), in their order, then new ones; the pending ones up to the
  position are acknowledged then.

So after any failure and a resume, each entry is trained on once, by the trainer it was handed
to, in the same batches (cut by count). A job's consumer group starts at the stream's first
entry (``?start=$``: at its end); a new job on a group another job read goes on where that
one's group is (use another ``?group=``).

Redis unreachable: each command is retried (with backoff) for ``retry_s`` seconds, then the
trainer fails with a :class:`~paramserver.errors.StreamError` naming the stream.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qs, urlsplit

from paramserver.data.criteo import decode_records
from paramserver.errors import ConfigError, StreamError
from paramserver.inputs import STOP
from paramserver.streams.batching import (
    DEFAULT_MAX_BAD_RECORDS,
    Chunk,
    ChunkedReader,
    Decoder,
    RecordBatcher,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
MIN_READ_COUNT, MAX_READ_COUNT = 1024, 4096  # entries one XREADGROUP asks for: a batch's
ACK_COUNT = 10_000  # pending entries listed per XPENDING while acknowledging
LAG_EVERY_S = 1.0  # how often the group's lag is asked


@dataclass(frozen=True)
class RedisStream:
    """A Redis stream read by a consumer group: ``data_fn(trainer, num_trainers)`` of a job
    (calling it gives that trainer's :class:`RedisStreamReader`)."""

    host: str
    port: int
    stream: str
    batch_size: int = 512
    group: str = "paramserver"
    record_field: str = "line"
    start: str = "0"  # where a new group starts: "0" the stream's first entry, "$" its end
    decoder: Decoder = field(default=decode_records)
    max_bad_records: int = DEFAULT_MAX_BAD_RECORDS
    block_ms: int = 200  # how long one read waits for new entries
    retry_s: float = 30.0  # how long a command is retried while Redis is unreachable
    positioned: ClassVar[bool] = True  # see paramserver.inputs.reads_a_stream

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStream:
        """``redis://HOST:PORT/STREAM[?group=G&field=F&start=0|$]``."""
        parts = urlsplit(url)
        stream = parts.path.lstrip("/")
        if parts.scheme != "redis" or not parts.hostname or not stream:
            raise ConfigError(f"a Redis stream is redis://HOST:PORT/STREAM, got {url!r}")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"group", "field", "start"}
        if unknown:
            raise ConfigError(f"{url}: unknown options {sorted(unknown)} (group, field, start)")
        if query.get("start", "0") not in ("0", "$"):
            raise ConfigError(f"{url}: start is 0 (the first entry) or $ (the end)")
        named = {"group": "group", "field": "record_field", "start": "start"}
        settings: dict[str, Any] = {named[k]: v for k, v in query.items()}
        return cls(parts.hostname, parts.port or 6379, stream, **settings, **options)

    @property
    def name(self) -> str:
        return f"redis://{self.host}:{self.port}/{self.stream}"

    def connect(self, timeout_s: float = 10.0, retries: bool = True) -> Any:
        """A client whose commands wait ``timeout_s`` seconds at most for an answer.
        ``retries=False``: a failed command fails at once, for a caller that retries on its
        own (redis-py's default retries turn a 1 s timeout into about 13 s)."""
        import redis  # the `stream` extra: only jobs that read a stream need it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        connect_s = min(5.0, timeout_s)
        if retries:
            return redis.Redis(
                self.host, self.port, socket_timeout=timeout_s, socket_connect_timeout=connect_s
            )
        once = Retry(NoBackoff(), 0)
        return redis.Redis(
            self.host,
            self.port,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_s,
            retry=once,
        )

    def consumer(self, trainer: int) -> str:
        """Trainer ``trainer``'s consumer in the group."""
        return f"trainer-{trainer}"

    def check(self) -> None:
        """Before the job starts: Redis answers, and the group exists (created at ``start``,
        with the stream, where missing). A ConfigError says what failed."""
        import redis

        try:
            client = self.connect()
            client.ping()
            client.xgroup_create(self.stream, self.group, id=self.start, mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise ConfigError(f"{self.name}: {error}") from None
        except redis.RedisError as error:
            raise ConfigError(f"{self.name}: cannot reach Redis ({error})") from None

    def __call__(self, trainer: int, num_trainers: int) -> RedisStreamReader:
        return RedisStreamReader(self, self.consumer(trainer))


class RedisStreamReader(ChunkedReader):
    """One trainer's batches from the stream: a :class:`~paramserver.inputs.PositionedInput`
    (see the module doc), read and decoded in a background thread a few reads ahead (what it
    holds there no other trainer can read)."""

    def __init__(self, source: RedisStream, consumer: str):
        super().__init__(f"redis-{consumer}")
        self.source = source
        self.consumer = consumer
        self.client = source.connect(retries=False)  # _retrying() retries its commands
        self.batcher = RecordBatcher(
            source.decoder, source.batch_size, source.max_bad_records, source.name
        )
        self._after = "0"  # the first read of its own pending entries starts after this id
        self._lag: tuple[float, int | None] = (-LAG_EVERY_S, None)
        self.read_count = min(max(source.batch_size, MIN_READ_COUNT), MAX_READ_COUNT)

    def seek(self, position: dict[str, Any]) -> None:
        """Continue after entry ``position["id"]``: the pending entries up to it are in the
        checkpoint that saved it (acknowledged now); those after it are read first."""
        if self._started():
            raise StreamError(f"{self.source.name}: seek before the first batch only")
        if not isinstance(position, dict) or not isinstance(position.get("id"), str):
            raise StreamError(f"{self.source.name}: not a stream position: {position!r}")
        self.acknowledge(position)
        self._after, self._position = position["id"], position
        self.batcher.resume(position)

    def acknowledge(self, position: dict[str, Any]) -> None:
        """Acknowledge this consumer's pending entries up to ``position["id"]``."""
        self._acknowledge_up_to(self.client, self.consumer, position["id"], _Backoff(self.source))

    def acknowledge_every_trainer(
        self, positions: Mapping[int, dict[str, Any]], within_s: float
    ) -> int:
        """The job's final checkpoint, committed, holds each trainer's entries up to its
        position (by trainer): acknowledge them, in every trainer's consumer, on a connection
        of their own. Entries after a position (read ahead, not trained) stay pending: a resume
        reads them again. Gives up after about ``within_s`` seconds (a command under way then
        may take as long again) with a StreamError; returns the entries acknowledged."""
        client = self.source.connect(timeout_s=within_s, retries=False)
        backoff = _Backoff(self.source, limit_s=within_s, since=time.monotonic())
        try:
            return sum(
                self._acknowledge_up_to(
                    client, self.source.consumer(trainer), position["id"], backoff
                )
                for trainer, position in sorted(positions.items())
            )
        finally:
            client.close()

    def _acknowledge_up_to(self, client: Any, consumer: str, last: str, backoff: _Backoff) -> int:
        """Acknowledge ``consumer``'s pending entries up to id ``last``; returns how many."""
        source, acknowledged = self.source, 0
        while True:
            backoff.check_time()
            pending = self._retrying(
                lambda: client.xpending_range(
                    source.stream, source.group, "-", last, ACK_COUNT, consumername=consumer
                ),
                backoff,
            )
            if not pending:
                return acknowledged
            ids = [entry["message_id"] for entry in pending]
            command = functools.partial(client.xack, source.stream, source.group, *ids)
            acknowledged += int(self._retrying(command, backoff))
            if len(pending) < ACK_COUNT:
                return acknowledged

    lag_unit = "records"

    def lag(self) -> int | None:
        """Entries in the stream not yet handed to any consumer of the group (Redis's own
        count; None where it cannot tell), asked at most every second."""
        asked_at, lag = self._lag
        if time.monotonic() - asked_at >= LAG_EVERY_S:
            try:
                groups = self.client.xinfo_groups(self.source.stream)
                mine = [g for g in groups if g["name"].decode() == self.source.group]
                lag = mine[0].get("lag") if mine else None
            except Exception:  # the figure is for display only
                lag = None
            self._lag = (time.monotonic(), lag)
        return lag

    def _chunks(self) -> Iterator[Chunk]:
        """The reading thread's: the batches each read completes (an empty list where a read
        waited and found nothing new), until the job is asked to stop. After a lost connection
        it reads its own pending entries again, from the last one it saw: the entries of an
        answer lost on the way were handed to it all the same."""
        reads = _GroupReads(self)
        after, history = self._after, True
        try:
            while not STOP.is_set():
                entries = reads.pending_after(after) if history else reads.new()
                if entries is None:  # the connection was lost, and is back
                    history = True
                    continue
                if history and not entries:
                    history = False  # its pending entries are read: on to new ones
                    continue
                if entries:
                    after = entries[-1][0].decode()
                yield self.batcher.add(*_ids_and_values(entries, self.source.record_field))
        finally:
            reads.close()

    def _retrying(self, command: Callable[[], T], backoff: _Backoff | None = None) -> T:
        """``command()``, retried while Redis is unreachable, as long as ``backoff`` allows
        (by default ``retry_s`` seconds)."""
        import redis

        backoff = backoff or _Backoff(self.source)
        while True:
            try:
                answer = command()
            except (redis.ConnectionError, redis.TimeoutError) as error:
                backoff.failed(error)
            except redis.ResponseError as error:  # the stream or the group deleted, say
                raise StreamError(f"{self.source.name}: {error}") from None
            else:
                backoff.succeeded()
                return answer


class _Backoff:
    """Waits between attempts while Redis is unreachable, doubling to 2 s; past ``limit_s``
    (by default ``retry_s``) since the first failure (since the last success), or since
    ``since`` where given, a StreamError naming the stream."""

    def __init__(
        self, source: RedisStream, limit_s: float | None = None, since: float | None = None
    ):
        self.source = source
        self.limit_s = source.retry_s if limit_s is None else limit_s
        self.since = since  # a fixed start: every wait counts, failures or not
        self.failing_since = since
        self.wait = 0.05

    def failed(self, error: Exception) -> None:
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if now + self.wait - self.failing_since > self.limit_s:
            raise StreamError(
                f"{self.source.name}: Redis unreachable for {self.limit_s:g} s ({error})"
            ) from None
        log.warning("%s: %s; retrying", self.source.name, error)
        time.sleep(self.wait)
        self.wait = min(self.wait * 2, 2.0)

    def check_time(self) -> None:
        """Past a fixed start's limit, a StreamError, even while Redis answers."""
        if self.since is not None and time.monotonic() - self.since > self.limit_s:
            raise StreamError(f"{self.source.name}: not done within {self.limit_s:g} s")

    def succeeded(self) -> None:
        self.failing_since, self.wait = self.since, 0.05


class _GroupReads:
    """One consumer's ``XREADGROUP`` calls, on a connection of its own: each read of new
    entries is sent as soon as the last one's answer is in, so Redis serves it while the last
    ones are decoded. A lost connection is made again (with backoff, for ``retry_s``: then a
    StreamError); the read that was under way answers None."""

    def __init__(self, reader: RedisStreamReader):
        self.reader = reader
        self.source = reader.source
        self.connection: Any = None
        self.sent = False  # a read of new entries is under way
        self.backoff = _Backoff(reader.source)

    def pending_after(self, after: str) -> list[Any] | None:
        """This consumer's pending entries after id ``after``."""
        return self._read(after, ahead=False)

    def new(self) -> list[Any] | None:
        """New entries (waiting ``block_ms`` for some), the next read sent at once."""
        return self._read(">", ahead=True)

    def _read(self, after: str, ahead: bool) -> list[Any] | None:
        import redis

        try:
            if self.connection is None:
                self.connection = redis.Connection(
                    self.source.host, self.source.port, socket_timeout=10, socket_connect_timeout=5
                )
                self.connection.connect()
            if not self.sent:
                self._send(after)
            self.sent = False
            entries = _entries(self.connection.read_response())
            if ahead and entries:
                self._send(">")
                self.sent = True
        except (redis.ConnectionError, redis.TimeoutError) as error:
            self.close()
            self.backoff.failed(error)
            return None
        except redis.ResponseError as error:  # the stream or the group deleted, say
            raise StreamError(f"{self.source.name}: {error}") from None
        self.backoff.succeeded()
        return entries

    def _send(self, after: str) -> None:
        block = ("BLOCK", self.source.block_ms) if after == ">" else ()
        self.connection.send_command(
            "XREADGROUP", "GROUP", self.source.group, self.reader.consumer,
            "COUNT", self.reader.read_count, *block, "STREAMS", self.source.stream, after,
        )  # fmt: skip

    def close(self) -> None:
        if self.connection is not None:
            self.connection.disconnect()
        self.connection, self.sent = None, False


def _entries(reply: Any) -> list[Any]:
    """The entries of an XREADGROUP answer (None: none came within the block)."""
    if not reply:
        return []
    streams = list(reply.values()) if isinstance(reply, dict) else [entries for _, entries in reply]
    return list(streams[0])


def _ids_and_values(entries: list[Any], name: str) -> tuple[list[bytes], list[bytes | None]]:
    """Each entry's id (bytes: a batch's position decodes its last one only) and the value of
    its field ``name``; a flat list of fields that starts with it is the common case."""
    wanted = name.encode()
    ids = [entry_id for entry_id, _ in entries]
    values = [
        fields[1]
        if type(fields) is list and fields and fields[0] == wanted
        else _field(fields, name)
        for _, fields in entries
    ]
    return ids, values


def _field(fields: Any, name: str) -> bytes | None:
    """A field's value in an entry's fields (a flat list of names and values, or a mapping);
    None where it has none, or the entry was deleted."""
    if not fields:
        return None
    if isinstance(fields, dict):
        return fields.get(name.encode())
    wanted = name.encode()
    return next((fields[i + 1] for i in range(0, len(fields), 2) if fields[i] == wanted), None)


@dataclass(frozen=True)
class RedisWindow:
    """Held-out data from a separate stream: its newest ``records`` entries, read afresh at each
    evaluation (``XREVRANGE``, by no consumer group), so the window moves with the stream; its
    bad records are left out. ``data_fn()`` of an :class:`~paramserver.metrics.Evaluation`."""

    source: RedisStream
    records: int = 10_000

    def __call__(self) -> Iterator[Any]:
        import redis

        source = self.source
        try:
            entries = source.connect().xrevrange(source.stream, "+", "-", count=self.records)
        except redis.RedisError as error:
            raise StreamError(f"{source.name} (held out): {error}") from None
        values = [_field(fields, source.record_field) for _, fields in reversed(entries)]
        present = [v for v in values if v is not None]
        for start in range(0, len(present), source.batch_size):
            rows, why = source.decoder(present[start : start + source.batch_size])
            if any(bad is None for bad in why):
                yield rows
