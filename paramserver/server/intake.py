"""A request's way in: checked whole and decoded into a
:class:`~paramserver.server.decoded.DecodedRequest`, or refused having changed nothing.

The steps, in order: the header (field types, the trainer); a departed trainer's call is
refused before its contents are looked at; ids packed together turned into ids per table; the
size against the cap; a repeat's gradients, already applied, are dropped; ids unpacked and
gradients decoded; gradients of pooled sums turned into row gradients, from the bags this
trainer pulled; the contents validated whole.
"""

from __future__ import annotations

import threading

from paramserver.config import ConsistencySettings
from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.server.decoded import DecodedRequest
from paramserver.server.idempotency import CallNumbers
from paramserver.server.liveness import Liveness
from paramserver.server.pooling import PooledPulls
from paramserver.server.shard import ServerShard, bag_grads_to_rows
from paramserver.wire.messages import PooledGrad, PushPullRequest


class Intake:
    """Server ``shard``'s intake of requests, with the shard's checks. What it reads of the
    trainers' standing, their calls and the bags they pulled is guarded by the coordinator's
    ``lock``, which it takes. Thread-safe; it changes nothing but the request it decodes
    (and the count of bytes received)."""

    def __init__(
        self,
        shard: ServerShard,
        settings: ConsistencySettings,
        lock: threading.Lock,
        liveness: Liveness,
        calls: CallNumbers,
        pooled: PooledPulls,
    ):
        self.server = shard.server
        self.checks = shard.checks
        self.stats = shard.stats
        self.num_trainers = settings.num_trainers
        self.max_message_bytes = settings.max_message_bytes
        self.lock = lock
        self.liveness = liveness
        self.calls = calls
        self.pooled = pooled

    def push_pull(self, request: PushPullRequest) -> DecodedRequest:
        """``request`` checked whole and decoded (a repeat's gradients dropped first), its
        bytes on the wire counted. Raises ParamServerError, changing nothing."""
        self.checks.check_header(request, self.num_trainers)
        with self.lock:
            repeat = self.calls.taken(request.trainer, request.call)
            departure = self.liveness.departure(request.trainer)
        if departure is not None:  # before its contents are looked at
            raise departure
        packing = self.checks.expand(request, self.max_message_bytes)
        received = self.checks.check_size(request, self.max_message_bytes) + packing
        if repeat:
            request.drop_gradients()  # already applied: only the reads are answered
        self.checks.decode_request(request)
        self._expand_pooled_grads(request)
        self.checks.validate(request)
        with self.stats.lock:
            self.stats.bytes_received += received
        return DecodedRequest.of(request)

    def pull(self, request: PushPullRequest) -> DecodedRequest:
        """A read-only ``request`` checked whole and decoded; raises ParamServerError."""
        self.checks.check_header(request, self.num_trainers)
        self.checks.expand(request, self.max_message_bytes)
        if request.has_grads or request.final or request.buffers:
            raise ParamServerError(
                f"server {self.server}: a pull must carry no gradients or buffers; use push_pull"
            )
        self.checks.check_size(request, self.max_message_bytes)
        self.checks.decode_request(request)  # its ids: it carries no gradients
        self.checks.validate(request)
        return DecodedRequest.of(request)

    def _expand_pooled_grads(self, request: PushPullRequest) -> None:
        """Turn gradients of pooled vectors into row gradients, using the bags this trainer
        pulled; raises InvalidPushError (and changes nothing) if they do not match."""
        for name, pooled in request.pooled_grads.items():
            if type(pooled) is not PooledGrad or type(pooled.pull_call) is not int:
                raise InvalidPushError("malformed pooled gradient", param=name, server=self.server)
            with self.lock:
                bags = self.pooled.of(request.trainer, pooled.pull_call, name)
            if bags is None:
                raise InvalidPushError(
                    f"no pooled pull at call {pooled.pull_call} to match",
                    param=name,
                    server=self.server,
                )
            if name in request.row_grads:
                raise InvalidPushError(
                    "both row and pooled gradients", param=name, server=self.server
                )
            grads = self.checks.pooled_grads(name, pooled.grads, bags.num_bags)
            request.row_grads[name] = bag_grads_to_rows(bags, grads)
