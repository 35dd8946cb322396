"""A change log on disk: each training server's chain of segments, listed in its manifest.

Layout under a publish directory ``DIR``::

    DIR/
      server-0/
        MANIFEST.json                 the chain: every kept segment, in order, with its place
        segment-000000000001.pslog    one segment (paramserver.changelog.segment)
        segment-000000000002.pslog
        .writer.lock                  flock held by the one process writing the chain
      server-1/
        ...

A server appends (:class:`LogWriter`): it writes the segment under a temporary name, fsyncs
and renames it, then rewrites the manifest the same way. A reader that sees a segment in the
manifest so finds it whole; a segment on disk that no manifest lists is not yet published.
A manifest keeps the newest ``keep`` segments, and every segment since the newest committed
checkpoint however many (older ones are deleted after the manifest that drops them; in a job
with checkpoints, every segment since the job's start until its first commits): a follower
that falls further behind is told so, and can ask first (:meth:`ChainFollower.gap`).

A chain outlives its server process: a server restarted, or a job resumed, numbers on from
the chain's last segment. Where its store does not end at that segment's change (resumed from
an earlier checkpoint: the log holds changes the store no longer has), its first segment is
*full* (every row and dense value it holds), which replaces that server's part whatever came
before it, and its store numbers its changes after the log's, so they only ever rise along
the chain.

A follower (:class:`ChainFollower`) reads each server's manifest, takes the segments after the
last it applied, and checks the chain: each segment names the one before it (``previous``),
numbers rise by one, each starts at the change the one before it ended at, and each file's
header agrees with its manifest entry. A gap, a duplicate or a segment out of order is a
:class:`~paramserver.errors.ChangeLogError` naming the file, and nothing of that server's new
segments is handed on. A full segment is taken after anything, and a follower starts at the
newest full segment it has not applied (what came before it no longer matters). Before it
applies any, a follower's place in the chain is the last segment its base covers whole
(:meth:`ChainFollower.covered_by_base`).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paramserver.changelog.segment import Segment, read_segment, write_segment
from paramserver.errors import ChangeLogError
from paramserver.files import write_atomic

MANIFEST = "MANIFEST.json"
WRITER_LOCK = ".writer.lock"
FORMAT = 1
DEFAULT_KEEP = 3600  # an hour of segments at one a second
_SERVER_DIR = re.compile(r"server-(0|[1-9][0-9]*)")


def segment_name(sequence: int) -> str:
    return f"segment-{sequence:012d}.pslog"


def server_dir(root: str | os.PathLike[str], server: int) -> Path:
    return Path(root) / f"server-{server}"


@dataclass(frozen=True)
class Listed:
    """A manifest's entry for one segment: its place in the chain, its file, what it covers."""

    sequence: int
    previous: int
    file: str
    size: int
    first_step: int
    last_step: int
    after_changes: int
    changes: int
    full: bool


@dataclass(frozen=True)
class Manifest:
    writer: str
    server: int
    segments: tuple[Listed, ...]

    @property
    def last(self) -> int:
        """The newest segment's sequence (0: none yet)."""
        return self.segments[-1].sequence if self.segments else 0


class LogWriter:
    """Server ``server``'s chain under ``root`` (see the module doc): each :meth:`append`
    publishes one segment. A writer continues the chain it finds there (a job resumed, or a
    server restarted), numbering on from its last segment."""

    def __init__(
        self, root: str | os.PathLike[str], writer: str, server: int, keep: int = DEFAULT_KEEP
    ):
        if keep < 1:
            raise ValueError(f"a change log keeps at least one segment, not {keep}")
        self.directory = server_dir(root, server)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer_id, self.server, self.keep = writer, server, keep
        self._lock_fd: int | None = _writer_lock(self.directory, writer)
        found = read_manifest(self.directory) if (self.directory / MANIFEST).exists() else None
        self.segments: list[Listed] = list(found.segments) if found else []
        # Beyond the newest ``keep``, segments are dropped only up to this store change (a
        # checkpoint's, which replay starts from: see ServerCheckpoints); by default all.
        self.keep_after: float = float("inf")

    @property
    def last(self) -> int:
        return self.segments[-1].sequence if self.segments else 0

    @property
    def last_changes(self) -> int:
        """The store change the chain's newest segment ends at (0: no segment)."""
        return self.segments[-1].changes if self.segments else 0

    def close(self) -> None:
        """Let another writer take this chain (the lock goes with the process too)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def append(self, segment: Segment, codec: str = "none") -> Listed:
        """Publish ``segment`` (its ``sequence`` and ``previous`` are set here) durably:
        its file, then the manifest that lists it; returns its entry."""
        segment.writer, segment.server = self.writer_id, self.server
        segment.previous, segment.sequence = self.last, self.last + 1
        name = segment_name(segment.sequence)
        size, _ = write_atomic(
            self.directory / name, lambda f: write_segment(f, segment, codec), hash_written=False
        )
        listed = Listed(
            segment.sequence, segment.previous, name, size, segment.first_step,
            segment.last_step, segment.after_changes, segment.changes, segment.full,
        )  # fmt: skip
        listing = [*self.segments, listed]
        old = listing[: -self.keep]  # changes rise along the chain: those covered come first
        dropped = list(itertools.takewhile(lambda e: e.changes <= self.keep_after, old))
        kept = listing[len(dropped) :]
        document = {
            "format": FORMAT,
            "writer": self.writer_id,
            "server": self.server,
            "segments": [asdict(entry) for entry in kept],
        }
        text = json.dumps(document, separators=(",", ":")).encode()
        write_atomic(self.directory / MANIFEST, lambda f: f.write(text), hash_written=False)
        self.segments = kept  # only once listed: a failed write is tried again as this number
        for entry in dropped:  # only once no manifest lists them
            (self.directory / entry.file).unlink(missing_ok=True)
        return listed


def _writer_lock(directory: Path, writer: str) -> int | None:
    """Hold ``flock`` on the chain's lock file for this writer's life: two processes writing
    one chain would number over each other's segments. None where the file system has no
    flock (then nothing guards the chain)."""
    path = directory / WRITER_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if error.errno in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise ChangeLogError(
            f"change log {directory}: another process writes this chain ({holder}); a "
            f"publish directory takes one job at a time"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, writer.encode(), 0)
    return fd


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """The manifest of one server's directory, every field checked."""
    path = Path(directory) / MANIFEST
    try:
        document = json.loads(path.read_bytes())
    except OSError as error:
        raise ChangeLogError(f"change log manifest {path}: cannot read it: {error}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ChangeLogError(f"change log manifest {path}: not JSON: {error}") from None
    problem = _manifest_problem(document)
    if problem:
        raise ChangeLogError(f"change log manifest {path}: {problem}")
    segments = tuple(Listed(**entry) for entry in document["segments"])
    return Manifest(document["writer"], document["server"], segments)


def _manifest_problem(document: Any) -> str | None:
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        return f"not a format {FORMAT} manifest"
    if not isinstance(document.get("writer"), str) or type(document.get("server")) is not int:
        return "writer must be a string and server an integer"
    segments = document.get("segments")
    if not isinstance(segments, list):
        return "segments must be a list"
    fields = set(Listed.__dataclass_fields__)
    for entry in segments:
        if not isinstance(entry, dict) or set(entry) != fields:
            return f"a segment entry must have the keys {sorted(fields)}: {entry!r}"
        if not all(type(entry[k]) is int and entry[k] >= 0 for k in fields - {"file", "full"}):
            return f"a segment entry's numbers must be integers >= 0: {entry!r}"
        if not isinstance(entry["full"], bool):
            return f"a segment entry's full must be true or false: {entry!r}"
        if entry["file"] != segment_name(entry["sequence"]):
            return f"segment {entry['sequence']} must be in {segment_name(entry['sequence'])}"
    return None


def servers_under(root: str | os.PathLike[str]) -> list[int]:
    """The servers that publish under ``root`` (those with a directory there), in order."""
    found = [_SERVER_DIR.fullmatch(entry.name) for entry in os.scandir(root) if entry.is_dir()]
    return sorted(int(match[1]) for match in found if match)


def published_servers(root: str | os.PathLike[str]) -> list[int]:
    """The servers under ``root`` whose chain lists a segment (a manifest that cannot be read
    counts: something wrote there)."""
    if not Path(root).is_dir():
        return []
    found = []
    for server in servers_under(root):
        directory = server_dir(root, server)
        try:
            listed = (directory / MANIFEST).exists() and bool(read_manifest(directory).segments)
        except ChangeLogError:
            listed = True
        if listed:
            found.append(server)
    return found


class ChainFollower:
    """Follows one server's chain (see the module doc) from a state that covers that server's
    store up to change ``changes`` (a base's: its checkpoint records it; 0: the job's start)."""

    def __init__(self, root: str | os.PathLike[str], server: int, changes: int = 0, most: int = 64):
        """``most``: the segments one :meth:`pending` reads at most (a follower far behind
        catches up in several); :attr:`more` says whether it left some."""
        self.directory = server_dir(root, server)
        self.server = server
        self.applied: int | None = None  # the last segment applied (None: none since the base)
        self.changes = changes
        self.most = most
        self.more = False
        self._read_before: dict[Listed, Segment] = {}  # pending but not applied: not read again

    def pending(self) -> tuple[list[Segment], ChangeLogError | None]:
        """The segments after the state followed (the first ``most``), read and checked, in
        order, up to the first that breaks the chain, whose error comes beside them (None: no
        break). Taking them applies nothing: the caller says which it applied
        (:meth:`applied_up_to`)."""
        if not (self.directory / MANIFEST).exists():
            return [], None
        found: list[Segment] = []
        read: dict[Listed, Segment] = {}
        try:
            manifest = read_manifest(self.directory)
            if manifest.server != self.server:
                raise ChangeLogError(
                    f"change log manifest {self.directory / MANIFEST} is server "
                    f"{manifest.server}'s, in server {self.server}'s directory"
                )
            newer = self._newer(manifest.segments)
            self.more = len(newer) > self.most
            after = (newer[0].previous, self.changes) if newer else None
            for entry in newer[: self.most]:
                assert after is not None
                read[entry] = self._read(entry, *after, first=not found)
                found.append(read[entry])
                after = (entry.sequence, entry.changes)
        except ChangeLogError as error:
            return found, error
        finally:
            self._read_before = read
        return found, None

    def applied_up_to(self, segment: Segment) -> None:
        """``segment`` (the last of those :meth:`pending` gave) and those before it applied."""
        self.applied, self.changes = segment.sequence, segment.changes

    def gap(self) -> str | None:
        """Why this chain no longer holds the segments the state followed needs next (its
        writer pruned them: its oldest kept comes after them), with no full segment among the
        newer ones to start from instead; None where it holds them, or lists none yet. A
        manifest that cannot be read is :meth:`pending`'s to report."""
        try:
            exists = (self.directory / MANIFEST).exists()
            segments = read_manifest(self.directory).segments if exists else ()
        except ChangeLogError:
            return None
        newer = self._after(segments)
        if not newer or any(entry.full for entry in newer):
            return None
        if self.applied is None:
            return self._base_gap(newer)
        if newer[0] == segments[0] and newer[0].sequence > self.applied + 1:
            return (
                f"change log {self.directory}: its oldest segment kept is "
                f"{newer[0].sequence}, but the last applied is {self.applied}: the segments "
                f"between were pruned before they were read"
            )
        return None

    def covered_by_base(self) -> Listed | None:
        """The newest segment listed whose changes the base covers whole (None: none listed):
        where the base stands in the chain before any segment is applied."""
        if not (self.directory / MANIFEST).exists():
            return None
        try:
            segments = read_manifest(self.directory).segments
        except ChangeLogError:
            return None
        covered = [entry for entry in segments if entry.changes <= self.changes]
        return covered[-1] if covered else None

    def _after(self, segments: tuple[Listed, ...]) -> list[Listed]:
        """The entries after the state followed: after the last applied, or from the base on
        (the first that reaches past the base's change)."""
        if self.applied is not None:
            return [entry for entry in segments if entry.sequence > self.applied]
        return [entry for entry in segments if entry.changes > self.changes]

    def _base_gap(self, newer: list[Listed]) -> str | None:
        if newer[0].after_changes <= self.changes:
            return None
        return (
            f"change log {self.directory}: its oldest segment kept starts after change "
            f"{newer[0].after_changes}, past the base's change {self.changes}: the log no "
            f"longer reaches back to the base"
        )

    def _newer(self, segments: tuple[Listed, ...]) -> list[Listed]:
        """The entries after the state followed (:meth:`_after`), from the newest full
        segment among them, which replaces everything before it."""
        newer = self._after(segments)
        full = [i for i, entry in enumerate(newer) if entry.full]
        if full:
            return newer[full[-1] :]
        gap = self._base_gap(newer) if self.applied is None and newer else None
        if gap is not None:
            raise ChangeLogError(gap)
        return newer

    def _read(self, entry: Listed, sequence: int, changes: int, *, first: bool) -> Segment:
        """The segment of ``entry``, which must come right after segment ``sequence``, which
        ended at change ``changes`` (``first``: the base's change, inside the entry's)."""
        path = self.directory / entry.file
        if not entry.full and (self.applied is not None or not first):
            if entry.previous != sequence or entry.sequence != sequence + 1:
                raise ChangeLogError(
                    f"change log segment {path}: numbered {entry.sequence} after "
                    f"{entry.previous}, but the next after {sequence} is {sequence + 1} (a "
                    f"gap, a duplicate or out of order)"
                )
            if entry.after_changes != changes:
                raise ChangeLogError(
                    f"change log segment {path}: starts after change {entry.after_changes} "
                    f"of server {self.server}'s store, but the state followed ends at change "
                    f"{changes} (a segment lost, or segments of another job)"
                )
        segment = self._read_before.get(entry) or read_segment(path)
        told = (segment.server, segment.sequence, segment.previous, segment.changes, segment.full)
        if told != (self.server, entry.sequence, entry.previous, entry.changes, entry.full):
            raise ChangeLogError(
                f"change log segment {path}: its header (server, sequence, previous, changes, "
                f"full) {told} disagrees with its manifest entry"
            )
        return segment
