"""Atomic, verified checkpoints that many processes write into one directory tree.

Layout under a checkpoint root ``ROOT``::

    ROOT/
      ckpt-0000000120/      one directory per checkpoint, named by its step (10 digits or more)
        server-0.pt         a part: a dict of tensors (torch.save)...
        server-0.json       ...and its JSON metadata; one pair per writer (server, trainer)
        trainer-0.pt
        trainer-0.json
        manifest.json       written last, at commit: every file with its size and sha256, the
                            step, the job's metadata and the id of the job that committed it
      LATEST                the name of the newest committed checkpoint
      LOCK                  the job that uses ROOT (see :mod:`paramserver.checkpoint.lock`)

Each process writes its own parts with :func:`write_part` and hands the returned :class:`Part`
(small and picklable, so it can travel by RPC) to one process, the chief, which calls
:func:`commit`. Readers call :func:`load_latest`.

Why a crash at any instant leaves a loadable checkpoint:

* Every file is written to a temporary name in its final directory, flushed and fsynced, renamed
  over its final name, and then the directory is fsynced so that the rename itself is durable.
  ``rename`` within one directory is atomic: a reader sees the old file or the new one, never a
  mix.
* A checkpoint counts only once its ``manifest.json`` exists *and verifies* (every listed file
  has the listed size and sha256). The manifest is written only after the chief has re-hashed
  every part, so a checkpoint killed half-way has no manifest and is ignored, and one damaged
  later fails verification and is skipped.
* ``LATEST`` is replaced the same way, after the manifest and ``ROOT`` are fsynced, so a reader
  sees either the old ``LATEST`` or the new one, and the one it sees names a complete checkpoint.
  ``LATEST`` is a hint, not the source of truth: when it is missing, garbage or names a checkpoint
  that does not verify, :func:`load_latest` scans every ``ckpt-*`` directory, newest first.
* Old checkpoints are deleted only after the new ``LATEST`` is durable, manifest first, so a
  half-deleted directory is merely uncommitted.

Every writer must see the same ``ROOT``: one local disk for a single host, a shared file system
(NFS, Lustre, a FUSE mount of object storage with close-to-open consistency) across hosts. A
writer closes its files before it returns its Part, and the chief opens them after, which is the
point where such file systems guarantee the chief sees the writer's bytes.

One job uses a ``ROOT`` at a time: it holds ``ROOT/LOCK`` (:mod:`paramserver.checkpoint.lock`),
:func:`commit` refuses to commit while another live job holds it, and it never points ``LATEST``
at a step older than the intact checkpoint ``LATEST`` names: a job that does not hold the lock
(the store used on its own) still cannot turn a newer checkpoint into an older one.

Tensors are loaded with ``torch.load(weights_only=True)``: a checkpoint from an untrusted place
cannot run code, and metadata lives in JSON, not in pickles.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from paramserver.checkpoint.lock import committer_job
from paramserver.checkpoint.manifest import (
    MANIFEST,
    SHA256_HEX,
    FileDigests,
    Manifest,
    is_count,
    is_part_name,
    manifest_document,
    parse_manifest,
    read_manifest_json,
)
from paramserver.errors import CheckpointError
from paramserver.files import fsync_dir, hash_stream, write_atomic

logger = logging.getLogger(__name__)

LATEST = "LATEST"

_DIR_NAME = re.compile(r"ckpt-([0-9]{10,})")


@dataclass(frozen=True)
class Part:
    """What one writer wrote into a checkpoint directory: ``name.pt`` and ``name.json``, each
    with its size and sha256. The chief checks these against the disk before it commits."""

    name: str
    files: FileDigests


DENSE_PART = "dense"
"""The part the chief trainer writes under ``--dense-sync allreduce``: the dense values and
their optimizer state, in a server part's format (``dense/NAME/...``, no tables)."""


def is_model_part(name: str) -> bool:
    """Whether part ``name`` holds model state (a server's shard or the trainers' dense part),
    not a trainer's position and RNG states."""
    return name.startswith("server-") or name == DENSE_PART


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint that verified when :func:`load_latest` found it."""

    directory: Path
    step: int  # the call number it was saved at (in sync mode, the training steps done)
    meta: dict[str, Any]  # the job's metadata, as given to commit()
    part_names: tuple[str, ...]  # sorted
    files: FileDigests = field(repr=False)
    job_id: str | None = None  # the job that committed it (None: committed without a lock)

    @classmethod
    def of(cls, manifest: Manifest, directory: Path) -> Checkpoint:
        return cls(
            directory, manifest.step, manifest.meta, manifest.parts, manifest.files, manifest.job_id
        )

    def read_part(self, name: str) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The tensors (on CPU) and metadata of part ``name``.

        The files are re-hashed as they are read, so a file changed since verification raises
        :class:`CheckpointError` instead of loading something other than what was committed.
        Raises ``KeyError`` if the checkpoint has no such part.
        """
        if name not in self.part_names:
            raise KeyError(f"{self.directory} has no part {name!r}; it has {list(self.part_names)}")
        with self._open_verified(f"{name}.pt") as f:
            try:
                tensors = torch.load(f, weights_only=True, map_location="cpu")
            except Exception as e:  # a verified file should load; say which one did not
                raise CheckpointError(f"{self.directory / f'{name}.pt'}: cannot load: {e}") from e
        if not (
            isinstance(tensors, dict)
            and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items())
        ):
            raise CheckpointError(f"{self.directory / f'{name}.pt'}: not a dict of tensors")
        return tensors, self._read_meta(name)

    @contextlib.contextmanager
    def open_part(self, name: str) -> Iterator[tuple[IO[bytes], dict[str, Any]]]:
        """Part ``name``'s tensor file, verified (as :meth:`read_part` does) and open for
        reading in pieces, and its metadata. The file is read from this open handle, so the
        bytes read are the bytes verified. Raises ``KeyError`` if there is no such part."""
        if name not in self.part_names:
            raise KeyError(f"{self.directory} has no part {name!r}; it has {list(self.part_names)}")
        meta = self._read_meta(name)
        with self._open_verified(f"{name}.pt") as f:
            yield f, meta

    def _read_meta(self, name: str) -> dict[str, Any]:
        with self._open_verified(f"{name}.json") as f:
            try:
                meta = json.loads(f.read())
            except (ValueError, RecursionError) as e:
                raise CheckpointError(f"{self.directory / f'{name}.json'}: invalid JSON") from e
        if not isinstance(meta, dict):
            raise CheckpointError(f"{self.directory / f'{name}.json'}: not a JSON object")
        return meta

    @contextlib.contextmanager
    def _open_verified(self, file_name: str) -> Iterator[IO[bytes]]:
        """The file, rewound after checking it against the manifest. Hashing and loading go
        through one open file, so a rename over the name in between cannot slip in other bytes."""
        path = self.directory / file_name
        try:
            f = open(path, "rb")  # noqa: SIM115 -- closed below, after the caller reads it
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open: {e}") from e
        with f:
            found = hash_stream(f)
            if found != self.files[file_name]:
                raise CheckpointError(
                    f"{path}: changed since the checkpoint was verified "
                    f"(now {found[0]} bytes, sha256 {found[1][:12]}...)"
                )
            f.seek(0)
            yield f


def checkpoint_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The directory of the checkpoint for ``step`` under ``root`` (not created)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return Path(root) / f"ckpt-{step:010d}"


def write_part(
    directory: str | os.PathLike[str],
    name: str,
    tensors: Mapping[str, Tensor],
    meta: Mapping[str, Any],
) -> Part:
    """Write ``name.pt`` (the tensors) and ``name.json`` (``meta``) into ``directory``, each
    atomically and durably; create the directory (and its parents) if needed.

    A tensor that is a view of a larger storage is saved as a contiguous copy of its own
    elements (torch.save would write the whole storage); one that owns its storage exactly is
    saved without a copy, so the caller must not modify the tensors until this returns.
    ``name`` is ``[A-Za-z0-9_.-]+``, not starting with ``.`` and not ``manifest``.
    """
    _check_part_name(name)
    meta_json = _json_bytes(meta)  # unserializable metadata fails before anything is written
    state: dict[str, Tensor] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not isinstance(tensor, Tensor):
            raise TypeError(f"part {name!r}: tensors must map str to Tensor, got {key!r}")
        state[key] = _compact(tensor)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files: FileDigests = {
        f"{name}.pt": write_atomic(directory / f"{name}.pt", lambda f: torch.save(state, f)),
        f"{name}.json": write_atomic(directory / f"{name}.json", lambda f: f.write(meta_json)),
    }
    return Part(name, files)


def commit(
    root: str | os.PathLike[str],
    step: int,
    parts: Sequence[Part],
    meta: Mapping[str, Any],
    keep: int = 2,
) -> Path:
    """Publish checkpoint ``step`` made of ``parts``; returns its directory.

    Re-hashes every part's files (so the manifest vouches for what is on disk, not for what the
    writers believe), writes ``manifest.json``, points ``LATEST`` at it, then deletes older
    directories so that ``keep`` committed checkpoints remain (this one included), and every
    uncommitted directory older than this one. Directories of newer steps are never touched:
    another step may be being written there. Blocks for the hashing and fsyncs.

    Raises :class:`CheckpointError`, committing nothing, if another live job holds ``ROOT/LOCK``
    or if ``LATEST`` names an intact checkpoint of a later step (``LATEST`` never goes back).
    The manifest records the id of the job holding the lock (see
    :func:`~paramserver.checkpoint.lock.committer_job`).
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 2:
        raise ValueError(
            f"keep must be an int >= 2 (a damaged newest needs a fallback), got {keep}"
        )
    if not parts:
        raise ValueError("commit needs at least one part")
    root = Path(root)
    directory = checkpoint_dir(root, step)
    job_id = committer_job(root)
    _check_not_older_than_latest(root, step)
    files = _rehash_parts(directory, parts)
    manifest = manifest_document(step, job_id, meta, [part.name for part in parts], files)
    _publish(root, directory, manifest)
    _prune(root, step, keep)
    return directory


def _rehash_parts(directory: Path, parts: Sequence[Part]) -> FileDigests:
    """Every part's files as found on disk, each checked against what its writer reported."""
    files: FileDigests = {}
    names: set[str] = set()
    for part in parts:
        _check_part(part)
        if part.name in names:
            raise ValueError(f"part {part.name!r} given twice")
        names.add(part.name)
        for file_name, expected in part.files.items():
            files[file_name] = _rehash_written(directory / file_name, part.name, expected)
    return files


def _rehash_written(path: Path, part_name: str, expected: tuple[int, str]) -> tuple[int, str]:
    """``path``'s (size, sha256), which must be what part ``part_name`` wrote there."""
    try:
        with open(path, "rb") as f:
            found = hash_stream(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (part {part_name!r} wrote it)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    if found != tuple(expected):
        raise CheckpointError(
            f"{path}: differs from what part {part_name!r} wrote "
            f"({found[0]} bytes on disk, {expected[0]} written; or a different sha256)"
        )
    return found


def _publish(root: Path, directory: Path, manifest: Mapping[str, Any]) -> None:
    """Commit ``directory``: its manifest, then ``LATEST`` naming it, each durable before the
    next is written (the order the module docstring explains)."""
    manifest_json = _json_bytes(manifest)
    write_atomic(directory / MANIFEST, lambda f: f.write(manifest_json))
    fsync_dir(root)  # the checkpoint's own entry in ROOT, before LATEST may name it
    write_atomic(root / LATEST, lambda f: f.write(f"{directory.name}\n".encode()))
    for leftover in root.glob(f".{LATEST}.*.tmp"):  # from a chief killed mid-write
        with contextlib.suppress(OSError):
            leftover.unlink()


def verify(directory: str | os.PathLike[str]) -> list[str]:
    """The problems of the checkpoint in ``directory``; empty if it is complete and intact.

    Checks the manifest's structure and that every file it lists is a regular file in
    ``directory`` with the listed size and sha256. Never raises on a damaged checkpoint.
    """
    return _inspect(Path(directory), hash_files=True)[1]


def load_latest(root: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest checkpoint under ``root`` that verifies, or None if there is no checkpoint.

    Tries the one ``LATEST`` names, then every other committed ``ckpt-*`` directory, newest
    first; each skipped one is logged as a warning with its problems. Raises
    :class:`CheckpointError` if checkpoints exist (or ``LATEST`` does) but none verifies: a job
    must not silently start from scratch after losing its checkpoints.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    latest_exists, latest_name, latest_problem = _read_latest(root)
    dirs = {path.name: path for _, path in sorted(_checkpoint_dirs(root), reverse=True)}
    candidates: list[Path] = []
    if latest_name is not None:
        if latest_name in dirs:
            candidates.append(dirs[latest_name])
        else:
            latest_problem = f"{LATEST} names {latest_name}, which does not exist"
    candidates += [
        path
        for path in dirs.values()
        if path not in candidates and os.path.lexists(path / MANIFEST)
    ]
    if not candidates and not latest_exists:
        return None
    failures: list[str] = []
    if latest_problem is not None:
        logger.warning("checkpoints under %s: %s; scanning the directories", root, latest_problem)
        failures.append(latest_problem)
    for path in candidates:
        manifest, problems = _inspect(path, hash_files=True)
        if manifest is not None and not problems:
            return Checkpoint.of(manifest, path)
        logger.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
        failures.append(f"{path.name}: {'; '.join(problems)}")
    if not candidates:
        failures.append("no committed checkpoint directory")
    raise CheckpointError(f"no checkpoint under {root} verifies: " + " | ".join(failures))


def open_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    """The committed checkpoint in ``directory``, verified; :class:`CheckpointError` naming
    every problem otherwise."""
    path = Path(directory)
    manifest, problems = _inspect(path, hash_files=True)
    if manifest is None or problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems or ["no usable manifest"]))
    return Checkpoint.of(manifest, path)


def _check_not_older_than_latest(root: Path, step: int) -> None:
    """Refuse ``step`` if ``LATEST`` names an intact checkpoint of a later step: LATEST never
    goes back. (A later one that does not verify is no checkpoint: a job resumed from the one
    before it may commit, and LATEST then names what a reader would load anyway.)"""
    if not root.is_dir():
        return
    _, latest_name, _ = _read_latest(root)
    if latest_name is None or (_step_of(latest_name) or 0) <= step:
        return
    manifest, problems = _inspect(root / latest_name, hash_files=True)
    if manifest is None or problems:
        return
    raise CheckpointError(
        f"{root}: not committing step {step}: {LATEST} names {latest_name}, a later intact "
        f"checkpoint (committed by job {manifest.job_id or 'unknown'}); {LATEST} never goes back. "
        "Is another job writing into this --checkpoint-dir?"
    )


def _inspect(directory: Path, *, hash_files: bool) -> tuple[Manifest | None, list[str]]:
    """The parsed manifest (None if unusable) and every problem found. Without ``hash_files``
    only sizes are checked: cheap enough for deciding what to delete at each commit."""
    document, problem = read_manifest_json(directory)
    if problem is not None:
        return None, [problem]
    manifest, problems = parse_manifest(document)
    if manifest is None:
        return None, problems
    step = _step_of(directory.name)
    if step is not None and step != manifest.step:
        problems.append(f"{MANIFEST} is for step {manifest.step}, the directory for step {step}")
    for name, (size, digest) in manifest.files.items():
        problem = _file_problem(directory / name, size, digest, hash_files=hash_files)
        if problem is not None:
            problems.append(f"{name}: {problem}")
    return manifest, problems


def _file_problem(path: Path, size: int, digest: str, *, hash_files: bool) -> str | None:
    """What is wrong with the file the manifest lists at ``path``, if anything."""
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_size != size:
            return f"size mismatch ({info.st_size} bytes, expected {size})"
        if hash_files:
            with open(path, "rb") as f:
                if hash_stream(f) != (size, digest):
                    return "sha256 checksum mismatch"
    except FileNotFoundError:
        return "missing file"
    except OSError as e:
        return f"unreadable ({e})"
    return None


def _prune(root: Path, step: int, keep: int) -> None:
    """Delete what is older than ``step`` beyond the ``keep - 1`` newest intact checkpoints."""
    kept = 1  # the one just committed
    for older_step, path in sorted(_checkpoint_dirs(root), reverse=True):
        if older_step >= step:
            continue
        if kept < keep:
            manifest, problems = _inspect(path, hash_files=False)
            if manifest is not None and not problems:
                kept += 1
                continue
        with contextlib.suppress(FileNotFoundError):
            (path / MANIFEST).unlink()  # uncommitted first: a half-deleted one is never loaded
        try:
            shutil.rmtree(path)
        except OSError as e:  # the new checkpoint is already published; the next commit retries
            logger.warning("could not delete old checkpoint %s: %s", path, e)


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the checkpoints committed under ``root`` (a manifest written), in order;
    not verified (see :func:`load_latest`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(step for step, path in _checkpoint_dirs(root) if os.path.lexists(path / MANIFEST))


def _read_latest(root: Path) -> tuple[bool, str | None, str | None]:
    """Whether ``LATEST`` exists, the checkpoint name it holds (if valid) and its problem."""
    try:
        with open(root / LATEST, "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return False, None, None
    except OSError as e:
        return True, None, f"cannot read {LATEST}: {e}"
    text = raw.decode("ascii", errors="replace").strip()
    if not text:
        return True, None, f"{LATEST} is empty"
    if _step_of(text) is None:
        return True, None, f"{LATEST} holds {text[:40]!r}, not a checkpoint name"
    return True, text, None


def _checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every directory under ``root`` named as :func:`checkpoint_dir` names
    them; anything else in ``root`` is not ours and is left alone."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            step = _step_of(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, Path(entry.path)))
    return found


def _step_of(name: str) -> int | None:
    match = _DIR_NAME.fullmatch(name)
    if match is None or name != f"ckpt-{int(match[1]):010d}":
        return None
    return int(match[1])


def _compact(tensor: Tensor) -> Tensor:
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        return tensor.clone()
    owns_storage = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
    return tensor if owns_storage else tensor.clone(memory_format=torch.contiguous_format)


def _json_bytes(value: Mapping[str, Any]) -> bytes:
    return (json.dumps(dict(value), indent=1) + "\n").encode()


def _check_part_name(name: str) -> None:
    if not isinstance(name, str) or not is_part_name(name):
        raise ValueError(
            f"part name {name!r}: must match [A-Za-z0-9_.-]{{1,200}}, not start with '.' "
            "and not be 'manifest'"
        )


def _check_part(part: Part) -> None:
    """A Part may come from a peer by RPC: check its shape before trusting its file names."""
    if not isinstance(part, Part):
        raise ValueError(f"expected a Part, got {type(part).__name__}")
    _check_part_name(part.name)
    expected = {f"{part.name}.pt", f"{part.name}.json"}
    if not isinstance(part.files, dict) or set(part.files) != expected:
        raise ValueError(f"part {part.name!r}: files must be exactly {sorted(expected)}")
    for file_name, digest in part.files.items():
        if not (
            isinstance(digest, tuple | list)
            and len(digest) == 2
            and is_count(digest[0])
            and isinstance(digest[1], str)
            and SHA256_HEX.fullmatch(digest[1])
        ):
            raise ValueError(f"part {part.name!r}: {file_name}: not a (size, sha256) pair")
