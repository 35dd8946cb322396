"""A request's header: the types of its fields, checked before anything else reads them.

A peer may send anything that unpickles: a request of another type, a field of another type,
a trainer or call number out of range. :func:`check_header` refuses such a request first, so
that the checks of its size and contents (server/requests.py) can read its fields; it looks
at no tensor.
"""

from __future__ import annotations

from paramserver.errors import ParamServerError
from paramserver.wire.idcodec import PackedTables
from paramserver.wire.messages import PushPullRequest, RowBlocks
from paramserver.wire.reports import TrainerReport

# The request's fields that map parameter or table names to their parts.
NAMED_PARTS = (
    "dense_grads",
    "row_grads",
    "pull_rows",
    "pool_rows",
    "pooled_grads",
    "pull_versions",
    "pull_state",
    "buffers",
)


def check_header(request: object, server: int, num_trainers: int) -> None:
    """Refuse (ParamServerError) a ``request`` to server ``server`` whose fields are not of the
    types the protocol defines, or from a trainer outside ``num_trainers``."""
    if type(request) is not PushPullRequest:
        raise ParamServerError(f"server {server}: malformed request {type(request).__name__}")
    problem = request.malformed()
    if problem is not None:
        raise ParamServerError(f"server {server}: malformed request: {problem}")
    if type(request.trainer) is not int or not 0 <= request.trainer < num_trainers:
        raise ParamServerError(f"server {server}: unknown trainer {request.trainer!r}")
    if type(request.call) is not int or request.call < 0:
        raise ParamServerError(f"server {server}: bad call {request.call!r}")
    if type(request.grads_call) is not int or not -1 <= request.grads_call < request.call:
        raise ParamServerError(f"server {server}: bad grads_call {request.grads_call!r}")
    if type(request.grads_step) is not int or request.grads_step < -1:
        raise ParamServerError(f"server {server}: bad grads_step {request.grads_step!r}")
    flags = (request.final, request.pull_dense, request.pull_dense_state, request.publish)
    if not all(type(flag) is bool for flag in flags):
        raise ParamServerError(f"server {server}: malformed request: flags must be bools")
    for name in NAMED_PARTS:
        value = getattr(request, name)
        if type(value) is not dict or not all(type(k) is str for k in value):
            raise ParamServerError(
                f"server {server}: malformed request: {name} must map names to values"
            )
    pulls, grads = request.packed_pulls, request.packed_grads
    if (pulls is not None and type(pulls) is not PackedTables) or (
        grads is not None
        and not (
            type(grads) is RowBlocks
            and type(grads.values) is dict
            and all(type(k) is str for k in grads.values)
        )
    ):
        raise ParamServerError(f"server {server}: malformed request: packed ids of another kind")
    report = request.report
    if report is not None and not (
        type(report) is TrainerReport
        and report.trainer == request.trainer
        and report.is_well_formed()
    ):
        raise ParamServerError(f"server {server}: malformed trainer report")
