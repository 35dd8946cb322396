"""``paramserver.serve()``: a serving process's parts started together (the command line's
``paramserver serve`` calls it too).

The base: a checkpoint (a checkpoint directory's newest, or one ``ckpt-*`` directory), an
export (``paramserver export``'s file: it records no store changes, so each log is followed
from its start, which leaves every row at its newest value whatever the export's age), or
nothing (the job's initial model). Then the change logs under ``follow``, if given.

Started in order (the follower, HTTP, gRPC); where a part fails to start (its port taken, the
serve extra missing), the parts already started are stopped before the error is raised, so no
thread or listening socket outlives a failed start.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from paramserver.checkpoint import load_latest, open_checkpoint
from paramserver.checkpoint.manifest import MANIFEST
from paramserver.errors import CheckpointError, ConfigError
from paramserver.serving.follow import Follower
from paramserver.serving.frontend import Frontend
from paramserver.serving.http import HttpServing
from paramserver.serving.model import ServedModel
from paramserver.serving.protocol import WHOLE_MODEL
from paramserver.types import ModelFn

log = logging.getLogger(__name__)


@dataclass
class Serving:
    """A running serving process's parts (see :func:`serve`); :meth:`close` stops them."""

    served: ServedModel
    frontend: Frontend
    follower: Follower | None
    http: HttpServing | None
    grpc: object | None  # a GrpcServing: its module needs the serve extra

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    @property
    def grpc_port(self) -> int | None:
        return None if self.grpc is None else self.grpc.port  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
        for transport in (self.http, self.grpc):
            if transport is not None:
                transport.close()  # type: ignore[attr-defined]


def serve(
    model_fn: ModelFn,
    *,
    follow: str | os.PathLike[str] | None = None,
    base: str | os.PathLike[str] | None = None,
    example_inputs: Sequence[Tensor] | None = None,
    seed: int = 0,
    model_name: str = WHOLE_MODEL,
    host: str = "127.0.0.1",
    http_port: int | None = 8000,
    grpc_port: int | None = 8001,
    poll_s: float = 0.1,
    mmap_dir: str | os.PathLike[str] | None = None,
    http_timeout_s: float = 30.0,
    http_max_connections: int = 64,
) -> Serving:
    """Serve ``model_fn``'s model (built under the job's ``seed``) from ``base`` (see the
    module doc), following the change logs under ``follow``, over HTTP and gRPC on ``host``
    (ports 0: free ones; None: not that transport). ``example_inputs`` (the forward's tensor
    arguments, a batch of any size) make the whole model servable as ``model_name``; without
    them only the tables are. ``mmap_dir``: hold the fixed tables' rows in files there,
    mapped (see :mod:`paramserver.serving.model`). ``http_timeout_s``: the time an HTTP
    client has to send each request whole; ``http_max_connections``: HTTP connections at
    once, beyond which one is answered 503 (see :mod:`paramserver.serving.http`). Returns
    once it answers; :meth:`Serving.close` stops it."""
    served = ServedModel(model_fn, seed, mmap_dir)
    if base is not None:
        load_base(served, Path(base))
    frontend = Frontend(served, example_inputs, model_name)
    with contextlib.ExitStack() as started:  # on an error, what started is stopped
        follower = None
        if follow is not None:
            follower = Follower(served, follow, frontend.metrics, poll_s)
            follower.catch_up()  # what is published already, before the first answer
            follower.start()
            started.callback(follower.close)
        http = None
        if http_port is not None:
            http = HttpServing(
                frontend, host, http_port, timeout_s=http_timeout_s,
                max_connections=http_max_connections,
            )  # fmt: skip
            started.callback(http.close)
        grpc = None if grpc_port is None else _grpc_serving(frontend, host, grpc_port)
        started.pop_all()  # all started: Serving.close stops them from now on
    frontend.ready = True  # every transport listens
    return Serving(served, frontend, follower, http, grpc)


def _grpc_serving(frontend: Frontend, host: str, port: int) -> object:
    try:
        from paramserver.serving.grpc import GrpcServing
    except ImportError as error:
        raise ConfigError(
            f"serving over gRPC needs the serve extra (pip install 'paramserver[serve]'): {error}"
        ) from None
    return GrpcServing(frontend, host, port)


def load_base(served: ServedModel, base: Path) -> None:
    """Load ``base`` (a checkpoint directory or an export file) into ``served``."""
    if base.is_file():
        load_export(served, base)
        return
    found = open_checkpoint(base) if (base / MANIFEST).exists() else load_latest(base)
    if found is None:
        raise CheckpointError(f"{base}: no committed checkpoint to serve from")
    served.load_checkpoint(found)
    log.info("serving from checkpoint %s (step %d)", found.directory, found.step)


def load_export(served: ServedModel, path: Path) -> None:
    """An export's values into ``served``: every dense value and table row it has."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as error:
        raise CheckpointError(f"{path}: not an export paramserver can read: {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a state_dict")
    served.load_state(state, str(path))
