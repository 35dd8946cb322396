"""The operations a server exposes, in one table: what its endpoint dispatches by and checks
calls against (:class:`~paramserver.server.endpoint.ServerEndpoint`), and what the trainers'
typed stub calls through (:class:`~paramserver.transport.stub.ServerStub`). On the wire an
operation is its name (a frame's ``(op, args)``); in code it is one of these constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from paramserver.checkpoint import Part


@dataclass(frozen=True)
class Operation:
    """``name`` on the wire; ``args``, the types of its positional arguments, checked by the
    server before it runs; ``sized_by_coordinator``: its request and answer are measured
    against ``--max-message-mb`` by the coordinator (naming the parameter), not the endpoint."""

    name: str
    args: tuple[type, ...]
    sized_by_coordinator: bool = False


PUSH_PULL = Operation("push_pull", (object,), sized_by_coordinator=True)  # fields: coordinator's
PUSH_PULLS = Operation("push_pulls", (list,), sized_by_coordinator=True)  # calls in order
PULL = Operation("pull", (object,), sized_by_coordinator=True)
WAIT_ALL_LEFT = Operation("wait_all_left", ())
EXPORT_STATE = Operation("export_state", (bool,))
STATS = Operation("stats", ())
LOAD = Operation("load", ())
DENSE_CHECK = Operation("dense_check", (dict,))
FINGERPRINT = Operation("fingerprint", ())
INITIAL_BUFFERS = Operation("initial_buffers", ())
HEARTBEAT = Operation("heartbeat", (int, float))
DEPARTED = Operation("departed", ())
FINISH_JOB = Operation("finish_job", (bool,))
PLAN_CHECKPOINT = Operation("plan_checkpoint", (int,))
TAKE_CHECKPOINT = Operation("take_checkpoint", (int,))
CHECKPOINT_PART = Operation("checkpoint_part", (int,))
ADD_TRAINER_PART = Operation("add_trainer_part", (int, int, Part))
TRAINER_PARTS = Operation("trainer_parts", (int,))

# The calls that move a step's data (measured as such: PSClient.wire_bytes).
DATA_OPERATIONS = (PUSH_PULL, PUSH_PULLS, PULL)

OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        PUSH_PULL, PUSH_PULLS, PULL, WAIT_ALL_LEFT, EXPORT_STATE, STATS, LOAD, DENSE_CHECK,
        FINGERPRINT, INITIAL_BUFFERS, HEARTBEAT, DEPARTED, FINISH_JOB, PLAN_CHECKPOINT,
        TAKE_CHECKPOINT, CHECKPOINT_PART, ADD_TRAINER_PART, TRAINER_PARTS,
    )
}  # fmt: skip
