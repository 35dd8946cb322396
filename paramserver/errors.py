"""The typed errors paramserver raises.

Every error is constructible from its message alone: torch.distributed.rpc re-raises a remote
exception on the caller as ``type(message)``, so the message must carry everything a user needs
(the parameter, the server, what was wrong) and the structured fields are a local convenience.
"""

from __future__ import annotations


class ParamServerError(Exception):
    """Base class of every error paramserver raises on purpose."""


class ConfigError(ParamServerError, ValueError):
    """A configuration value is invalid; the message names the flag or field to change."""


class InvalidPushError(ParamServerError, ValueError):
    """A server rejected a whole push; none of it was applied.

    Raised for gradients of the wrong shape or dtype, unknown parameter or table names, row ids
    out of range or routed to the wrong server, and NaN or Inf values.
    """

    def __init__(self, message: str, *, param: str | None = None, server: int | None = None):
        if param is not None:
            message = f"parameter {param!r}: {message}"
        if server is not None:
            message = f"server {server}: {message}"
        super().__init__(message)
        self.param = param
        self.server = server


class TrainerDepartedError(ParamServerError):
    """A server refused a call from a trainer that already left (or was declared departed)."""


class ServerLostError(ParamServerError, ConnectionError):
    """A server died, froze or was cut off: its connection broke, or it left a call or a
    heartbeat unanswered past the timeout. The message names the server; ``server`` is its
    index (``None`` when rebuilt from a message alone); ``generation``, the RPC world the call
    was made in (see :func:`paramserver.transport.rpc.watch_restarts`), where known."""

    def __init__(self, message: str, *, server: int | None = None, generation: int | None = None):
        super().__init__(message)
        self.server = server
        self.generation = generation


class ModelError(ParamServerError, ValueError):
    """The user's model cannot be served as given (for example an embedding with ``max_norm``)."""


class JobFailedError(ParamServerError, RuntimeError):
    """A job process failed; the message names the process and how it ended."""


class InvalidBatchError(ParamServerError, IndexError):
    """A batch holds ids a table cannot serve (for example out of its row range), or the data
    it comes from is malformed; the message names the file and the line or column."""


class CheckpointError(ParamServerError):
    """A checkpoint is missing, incomplete or corrupt; the message names it and what is wrong."""


class LoopError(ParamServerError, RuntimeError):
    """A training loop used its context wrongly (``ctx.step()`` without a backward, twice for
    one batch, from another thread...); the message says what to change."""


class TrainerGroupError(ParamServerError, RuntimeError):
    """The trainers' all-reduce (``--dense-sync allreduce``) failed: a trainer died, froze past
    the group's timeout or failed, and a collective cannot go on without it."""


class StoreError(ParamServerError, ValueError):
    """A change a table cannot take: rows set that do not fit it, or ids deleted from a
    table whose rows cannot go (a fixed table's)."""


class ChangeLogError(ParamServerError):
    """A change log segment or manifest is missing, damaged, or out of its chain (a gap, a
    duplicate, an older segment after a newer one); the message names the file and what is
    wrong. Nothing of it is applied."""


class StreamError(ParamServerError, ConnectionError):
    """A stream source failed: its broker unreachable past the retries, or a stream gone."""
