"""Checkpoints: atomic, verified, written by many processes and committed by one (the chief).

See :mod:`paramserver.checkpoint.store` for the layout on disk and why it survives crashes, and
:mod:`paramserver.checkpoint.lock` for how one job at a time holds a checkpoint directory.
"""

from paramserver.checkpoint.lock import DirectoryLock, lock_directory
from paramserver.checkpoint.store import (
    Checkpoint,
    Part,
    checkpoint_dir,
    commit,
    load_latest,
    open_checkpoint,
    verify,
    write_part,
)
from paramserver.errors import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "DirectoryLock",
    "Part",
    "checkpoint_dir",
    "commit",
    "load_latest",
    "lock_directory",
    "open_checkpoint",
    "verify",
    "write_part",
]
