"""Training input from a folder that Criteo-format files keep arriving in (``--dataset
criteo-follow:DIR``): the "hourly partitions land in a folder" pattern.

A file is taken once it is complete: once ``NAME.done`` exists beside it (the producer writes
the file, then the marker), so a file still being written is left alone. Hidden files (a
leading ``.``) and the markers are not data. Files are read in name order, each once, each
split across the trainers as :class:`~paramserver.data.criteo.CriteoFiles` splits its files
(byte ranges cut at line starts; a gzip file whole to one trainer); a trainer's batches run on
from one file into the next. With nothing new the reader waits, looking again every
``poll_s`` seconds, until the job is asked to stop.

Its position (see :mod:`paramserver.inputs`) is the file and the count of this trainer's rows
of it trained: a resume reads on from the next row. A file that completes after a file with a
later name was read is out of order: it is skipped, with a warning (name files so that they
sort in time, as ``2026-12-06T13.csv``). A file deleted before it is read is skipped, with a
warning. A malformed line stops the job, naming its file and line, as with files given by
name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from paramserver.data.criteo import share_rows
from paramserver.data.splits import share_out, whole_files
from paramserver.errors import ConfigError, StreamError
from paramserver.inputs import STOP
from paramserver.streams.batching import Chunk, ChunkedReader, RecordBatcher

log = logging.getLogger(__name__)

DONE_SUFFIX = ".done"
LAG_EVERY_S = 1.0  # how often the folder is listed for the lag


@dataclass(frozen=True)
class FollowedFolder:
    """A folder of arriving Criteo files: ``data_fn(trainer, num_trainers)`` of a job."""

    directory: Path
    batch_size: int = 512
    hash_salt: int = 0
    poll_s: float = 1.0
    positioned: ClassVar[bool] = True  # see paramserver.inputs.reads_a_stream

    @property
    def name(self) -> str:
        return f"criteo-follow:{self.directory}"

    def check(self) -> None:
        if not Path(self.directory).is_dir():
            raise ConfigError(f"--dataset {self.name}: no such directory")

    def complete_files(self) -> list[str]:
        """The names of the complete data files, in name order."""
        names = {p.name for p in Path(self.directory).iterdir()}
        return sorted(
            name
            for name in names
            if not name.startswith(".")
            and not name.endswith(DONE_SUFFIX)
            and name + DONE_SUFFIX in names
        )

    def __call__(self, trainer: int, num_trainers: int) -> FolderReader:
        return FolderReader(self, trainer, num_trainers)


class FolderReader(ChunkedReader):
    """One trainer's batches from the folder: a :class:`~paramserver.inputs.PositionedInput`
    (see the module doc), read and parsed in a background thread a few blocks ahead."""

    def __init__(self, source: FollowedFolder, trainer: int, num_trainers: int):
        super().__init__(f"follow-{trainer}")
        self.source = source
        self.trainer, self.num_trainers = trainer, num_trainers
        self.batcher = RecordBatcher(None, source.batch_size, 0, source.name)  # rows come parsed
        self._after: tuple[str, int] | None = None  # (file, its rows read) to go on after
        self._lag: tuple[float, int] = (-LAG_EVERY_S, 0)

    def seek(self, position: dict[str, Any]) -> None:
        if self._started():
            raise StreamError(f"{self.source.name}: seek before the first batch only")
        where = position.get("id") if isinstance(position, dict) else None
        if not (isinstance(where, list) and len(where) == 2 and isinstance(where[0], str)):
            raise StreamError(f"{self.source.name}: not a folder position: {position!r}")
        self._after, self._position = (where[0], int(where[1])), position
        self.batcher.resume(position)

    def acknowledge(self, position: dict[str, Any]) -> None:
        """Nothing to tell: the files stay where they are."""

    lag_unit = "files"

    def lag(self) -> int:
        """Complete files after the one being read, looked at most every second."""
        asked_at, lag = self._lag
        if time.monotonic() - asked_at >= LAG_EVERY_S:
            where = self._position["id"][0] if self._position is not None else ""
            lag = sum(name > where for name in self.source.complete_files())
            self._lag = (time.monotonic(), lag)
        return lag

    def _chunks(self) -> Iterator[Chunk]:
        """The reading thread's: the batches each parsed block completes; an empty list
        where nothing new has arrived (it then waits ``poll_s``)."""
        last, skip = self._after if self._after is not None else ("", 0)
        first = self._after is not None  # the file of the saved position: read on in it
        listed: set[str] | None = None  # complete files seen so far
        while not STOP.is_set():
            complete = self.source.complete_files()
            files = [n for n in complete if n > last or (first and n == last)]
            if listed is not None:
                late = set(complete) - listed - set(files)
                for name in sorted(late):
                    log.warning(
                        "%s: %s completed after %s was read: out of name order, skipped",
                        self.source.name, name, last,
                    )  # fmt: skip
            listed = set(complete) | (listed or set())
            if not files:
                yield []
                time.sleep(self.source.poll_s)
                continue
            for name in files:
                yield from self._file_chunks(name, skip if first and name == last else 0)
                last, first = name, False
                if STOP.is_set():
                    return

    def _file_chunks(self, name: str, skip: int) -> Iterator[Chunk]:
        path = Path(self.source.directory) / name
        try:
            splits = share_out(whole_files([path]), self.num_trainers)[self.trainer]
            read = 0
            for rows in share_rows(splits, self.source.hash_salt):
                count = len(rows[1])
                if read + count <= skip:  # trained before the checkpoint
                    read += count
                    continue
                start = max(skip - read, 0)
                ids = [[name, read + i + 1] for i in range(start, count)]
                rows = ((rows[0][0][start:], rows[0][1][start:]), rows[1][start:])
                read += count
                yield self.batcher.add_rows(rows, ids, [0] * len(ids))
        except FileNotFoundError:
            log.warning("%s: %s was deleted before it was read; skipped", self.source.name, name)
