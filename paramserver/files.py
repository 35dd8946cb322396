"""Files written so that a crash at any instant leaves either the old content or all of the
new, durably: a temporary name in the final directory, flushed and fsynced, renamed over the
final name (atomic within one directory), then the directory fsynced so the rename itself is
durable. Checkpoints and change logs write every file this way."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

_CHUNK = 1 << 20


def write_atomic(
    path: Path, write: Callable[[IO[bytes]], object], *, hash_written: bool = True
) -> tuple[int, str]:
    """Write a file through ``write`` so that ``path`` holds either its old content or all of
    the new, durably; returns the new content's (size, sha256), hashed from what reached the
    file (with ``hash_written`` False: the size and an empty digest, the file not read
    back)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # os.open rather than mkstemp: mode 0o666 under the umask, as a plain open() would create.
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            if hash_written:
                f.seek(0)
                written = hash_stream(f)  # what reached the file, not what we meant to write
            else:
                written = f.tell(), ""
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return written


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a directory; their renames are durable
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def hash_stream(f: IO[bytes]) -> tuple[int, str]:
    """The (size, sha256) of what is left to read of ``f``."""
    sha = hashlib.sha256()
    size = 0
    while chunk := f.read(_CHUNK):
        sha.update(chunk)
        size += len(chunk)
    return size, sha.hexdigest()
