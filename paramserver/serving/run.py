"""``paramserver.serve()``: a serving process's parts started together (the command line's
``paramserver serve`` calls it too).

The base: a checkpoint (a checkpoint directory's newest, or one ``ckpt-*`` directory), an
export (``paramserver export``'s file: it records no store changes, so each log is followed
from its start, which leaves every row at its newest value whatever the export's age), or
nothing (the job's initial model). Then the change logs under ``follow``, if given.

A base the logs no longer reach is never served: where a log's writer has pruned the segments
that follow a base (``--publish-keep``), the model served would be neither the job's nor ever
become it. Without a base, serving then starts from the job's newest committed checkpoint
(``checkpoint_dir``, the job's: the log keeps every segment since it); a checkpoint directory
given as the base is read again for its newest. Where no base the logs reach is found,
:func:`serve` raises :class:`~paramserver.errors.ConfigError` saying what to pass, before
anything listens. The base is checked again once the logs are caught up with: a checkpoint
committed meanwhile may have pruned them (then the newest base is tried again, at most
:data:`BASE_TRIES` times).

Started in order (the follower, HTTP, gRPC); where a part fails to start (its port taken, the
serve extra missing), the parts already started are stopped before the error is raised, so no
thread or listening socket outlives a failed start.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Sequence
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

BASE_TRIES = 3  # bases tried where checkpoints committed meanwhile prune the logs under us


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
    http_max_connections: int = 2048,
    checkpoint_dir: str | os.PathLike[str] | None = None,
) -> Serving:
    """Serve ``model_fn``'s model (built under the job's ``seed``) from ``base`` (see the
    module doc), following the change logs under ``follow``, over HTTP and gRPC on ``host``
    (ports 0: free ones; None: not that transport). ``example_inputs`` (the forward's tensor
    arguments, a batch of any size) make the whole model servable as ``model_name``; without
    them only the tables are. ``mmap_dir``: hold the fixed tables' rows in files there,
    mapped (see :mod:`paramserver.serving.model`). ``http_timeout_s``: the time an HTTP
    connection has for each request and answer; ``http_max_connections``: HTTP connections
    open at once (see :mod:`paramserver.serving.connections`: idle ones never shut out others).
    ``checkpoint_dir``: the job's, whose newest checkpoint is a base (see the module doc).
    Returns once it answers; :meth:`Serving.close` stops it."""
    build = functools.partial(ServedModel, model_fn, seed, mmap_dir)
    frontend_of = functools.partial(Frontend, example=example_inputs, model_name=model_name)
    if follow is None:
        frontend, follower = frontend_of(_based(build(), base)), None
    else:  # a base the logs reach, caught up with them
        bases = Bases(Path(follow), base, checkpoint_dir)
        frontend, follower = bases.follow(build, frontend_of, poll_s)
    served = frontend.served
    with contextlib.ExitStack() as started:  # on an error, what started is stopped
        if follower is not None:
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


def _based(served: ServedModel, base: str | os.PathLike[str] | None) -> ServedModel:
    if base is not None:
        load_base(served, Path(base))
    return served


class Bases:
    """The bases a serving process that follows the logs under ``root`` tries, in order,
    until one every log reaches (see the module doc): ``base``, or else the job's initial
    model; then, where that was a checkpoint directory's newest or the initial model, the
    newest checkpoint of that directory or of ``checkpoint_dir`` (the job's)."""

    def __init__(
        self,
        root: Path,
        base: str | os.PathLike[str] | None,
        checkpoint_dir: str | os.PathLike[str] | None,
    ):
        self.root, self.base = root, None if base is None else Path(base)
        self.checkpoint_dir = None if checkpoint_dir is None else Path(checkpoint_dir)
        self.tried: list[str] = []  # each base tried that the logs do not reach
        self.gap = ""  # why they do not reach the last one

    def follow(
        self, build: Callable[[], ServedModel], frontend_of: Callable[[ServedModel], Frontend],
        poll_s: float,
    ) -> tuple[Frontend, Follower]:  # fmt: skip
        """A model ``build`` makes, on the first base the logs reach, caught up with them; its
        frontend (``frontend_of``) and its follower (not started)."""
        served, fresh = build(), True
        while True:
            if not fresh:  # a log was applied to it: the next base goes into a new model
                served = build()
            where = self._next(served)
            frontend = frontend_of(served)
            follower = Follower(served, self.root, frontend.metrics, poll_s)
            gaps = follower.gaps()
            if not gaps:
                follower.catch_up()  # what is published already, before the first answer
                gaps, fresh = follower.gaps(), False  # pruned meanwhile: a newer base
                if not gaps:
                    return frontend, follower
            first, *others = gaps.values()
            self.tried.append(where)
            self.gap = first + (f"; and {len(others)} other servers' logs" if others else "")

    def _next(self, served: ServedModel) -> str:
        """Load the next base into ``served`` (as built); says which it is."""
        if self.base is not None and (self.base.is_file() or (self.base / MANIFEST).exists()):
            if self.tried:
                self._refuse(f"--from {self.base} names one base, with none newer to try")
            load_base(served, self.base)
            return str(self.base)
        if self.base is None and not self.tried:
            return "the job's initial model"
        directory = self.base or self.checkpoint_dir
        if directory is None:
            self._refuse("the job recorded no --checkpoint-dir to serve its newest checkpoint")
        assert directory is not None
        newest = load_latest(directory)
        if newest is None:
            if self.base is not None:
                raise CheckpointError(f"{directory}: no committed checkpoint to serve from")
            self._refuse(f"the job's --checkpoint-dir {directory} holds no committed checkpoint")
        assert newest is not None
        where = f"checkpoint {newest.directory}"
        if self.tried and self.tried[-1] == where:
            self._refuse(f"{directory} holds no checkpoint newer")
        if len(self.tried) > BASE_TRIES:
            self._refuse(f"{BASE_TRIES} checkpoints were each pruned from the logs meanwhile")
        if self.tried:
            log.warning("the change logs under %s no longer reach back to %s (%s): serving "
                        "from %s instead", self.root, self.tried[-1], self.gap, where)  # fmt: skip
        served.load_checkpoint(newest)
        return where

    def _refuse(self, why_no_other: str) -> None:
        """No base left to try: say what was tried, why no other is, and what to pass."""
        raise ConfigError(
            f"the change logs under {self.root} no longer reach back to "
            f"{' nor '.join(self.tried)} ({self.gap}), and {why_no_other}: pass --from "
            f"(ps.serve base=) a checkpoint of this job that they reach (a job with "
            f"--checkpoint-dir keeps every segment since its newest checkpoint), or serve "
            f"without --follow"
        )


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
