"""Checkpoints: atomic, verified, written by many processes and committed by one (the chief).

See :mod:`paramserver.checkpoint.store` for the layout on disk and why it survives crashes,
:mod:`paramserver.checkpoint.lock` for how one job at a time holds a checkpoint directory, and
:mod:`paramserver.checkpoint.resume` for reading one back to resume, and
:mod:`paramserver.checkpoint.export` for writing its model as one state_dict file.
"""

from paramserver.checkpoint.lock import DirectoryLock, lock_directory
from paramserver.checkpoint.resume import (
    Saved,
    check_checkpoint_dir,
    gather_saved,
    resume_from,
    saved_dense,
)
from paramserver.checkpoint.store import (
    DENSE_PART,
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
    "DENSE_PART",
    "Checkpoint",
    "CheckpointError",
    "DirectoryLock",
    "Part",
    "Saved",
    "check_checkpoint_dir",
    "checkpoint_dir",
    "commit",
    "gather_saved",
    "load_latest",
    "lock_directory",
    "open_checkpoint",
    "resume_from",
    "saved_dense",
    "verify",
    "write_part",
]
