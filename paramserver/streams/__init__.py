"""Training input that does not end: sources that read a stream once, know where they are, and
continue from a checkpoint's saved position (:class:`paramserver.inputs.PositionedInput`).

- :class:`~paramserver.streams.redis.RedisStream`: a Redis stream read by a consumer group.
- :class:`~paramserver.streams.folder.FollowedFolder`: Criteo files arriving in a folder.

Each one is a ``data_fn`` for :func:`paramserver.train`: ``data_fn(trainer, num_trainers)``
gives that trainer's reader.
"""

from paramserver.streams.batching import Decoder, RecordBatcher
from paramserver.streams.folder import FolderReader, FollowedFolder
from paramserver.streams.redis import RedisStream, RedisStreamReader, RedisWindow

__all__ = [
    "Decoder",
    "FolderReader",
    "FollowedFolder",
    "RecordBatcher",
    "RedisStream",
    "RedisStreamReader",
    "RedisWindow",
]
