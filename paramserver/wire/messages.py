"""Messages between trainers and servers.

A trainer sends each server one :class:`PushPullRequest` per training step, each numbered
call ``0, 1, 2, ...`` (call 0 is the initial pull): the gradients of its last step go up and
the values it needs for the next step come back in the same round trip (:class:`PushPullReply`).
Words kept apart: a *call* is that number; a parameter's or row's *version* is how many updates
the server applied to it; *step* is a trainer's training step (and, in the optimizer, its per-row
step count); a checkpoint's *step* is the call number at which it was saved.

Row ids on the wire are *global* row ids of a table; each server owns the rows the routing rule
gives it (see :mod:`paramserver.sharding`). The sorted unique ids of a push's rows and of a pull
travel compactly, as a plain int64 tensor or a :class:`~paramserver.wire.idcodec.PackedIds` (see
:mod:`paramserver.wire.idcodec`), or, as trainers send them, every table's packed together
(:class:`~paramserver.wire.idcodec.PackedTables`, in ``packed_pulls`` and ``packed_grads``); a
server validates and unpacks them before anything else of the request is decoded.

Any float32 tensor of gradients or values may travel encoded (a
:class:`~paramserver.wire.compression.Encoded`, per the job's codecs); the receiver decodes it,
and a server validates it first.

On the wire (pickled, as the RPC transport sends them), each of a message's mappings of plain
tensors (gradients, ids, rows, versions) travels as one
:class:`~paramserver.wire.bundles.Bundle` per dtype, and an answer's row state as one
:class:`RowStateBlock` per kind of state: TensorPipe ships every tensor as a buffer of its own,
at a cost per tensor that a step with many tables would pay a hundred times. The receiver gets views
of the bundle, after checking it whole; a malformed one leaves a
:class:`~paramserver.wire.bundles.MalformedBundle` that ``malformed()`` reports.

A trainer's ``TrainerReport`` (sent with its last call: :mod:`paramserver.wire.reports`)
carries its call statistics and the summary of its replica checks; :class:`ServerView` is a
server's answer to one such check.

Ownership: once a message is handed to a transport the sender must not modify its tensors; the
receiver owns what it receives.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from paramserver.wire.bundles import Bundle, MalformedBundle, bundled, unbundled
from paramserver.wire.compression import Encoded
from paramserver.wire.idcodec import PackedIds, PackedTables, table_counts
from paramserver.wire.reports import TrainerReport


@dataclass
class RowBlock:
    """Rows of one table: ``ids`` holds sorted unique global row ids (1-D int64, or packed on
    the wire), ``values`` the matching ``[len(ids), dim]`` rows (gradients in a request,
    parameters in a reply)."""

    ids: Tensor | PackedIds
    values: Tensor | Encoded


@dataclass
class RowBlocks:
    """Rows of several tables as a trainer sends them to one server: their ids packed
    together (``ids``) and per table of ``ids.names`` its values (``[count, dim]``, in the
    order of its ids; a table of no ids is ignored). A server turns them into a
    :class:`RowBlock` per table with rows before it reads them
    (:meth:`paramserver.server.requests.RequestChecks.expand`)."""

    ids: PackedTables
    values: dict[str, Tensor | Encoded]

    def __getstate__(self) -> dict[str, Any]:
        return {"ids": self.ids, "values": bundled(self.values)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if type(state) is not dict:
            raise TypeError(f"row blocks' state must be a dict, got {type(state).__name__}")
        self.__dict__.update({**state, "values": unbundled(state.get("values"))})


@dataclass
class BagBlock:
    """Bags of one server-pooled table: ``ids[i]`` (int64, repeats allowed) belongs to bag
    ``bags[i]`` of ``num_bags``, weighted by ``weights[i]`` if given (sum pooling only)."""

    ids: Tensor
    bags: Tensor
    num_bags: int
    weights: Tensor | None = None

    @functools.cached_property
    def distinct(self) -> tuple[Tensor, Tensor]:
        """The distinct ids, sorted, and each id's index among them: computed once per block,
        at its first use (a server reads the bags' rows with it at the pull and sums the
        gradient of their pooled vectors into rows with it at the push). Derived by the
        receiver from validated ids: never pickled, and one in a peer's message is dropped."""
        return torch.unique(self.ids, return_inverse=True)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "distinct"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state.items() if k != "distinct"})


@dataclass
class PooledGrad:
    """The gradient of one table's pooled vectors ``[num_bags, dim]``, for the bags pulled by
    this trainer's call number ``pull_call``."""

    pull_call: int
    grads: Tensor | Encoded


@dataclass(frozen=True)
class RowBlocksBundle:
    """A request's ``row_grads`` as they travel: the blocks' ids and values as two mappings,
    each bundled where it can be."""

    ids: Bundle | dict[str, Any]
    values: Bundle | dict[str, Any]

    def unbundled(self) -> dict[str, RowBlock] | MalformedBundle:
        ids, values = unbundled(self.ids), unbundled(self.values)
        for part in (ids, values):
            if type(part) is MalformedBundle:
                return part
        if type(ids) is not dict or type(values) is not dict or ids.keys() != values.keys():
            return MalformedBundle("the ids and values of row blocks name different tables")
        return {name: RowBlock(ids[name], values[name]) for name in ids}


_BUNDLED_REQUEST_FIELDS = ("dense_grads", "pull_rows", "pull_versions", "pull_state")
_BUNDLED_REPLY_FIELDS = ("dense", "rows", "pooled", "row_versions", "dense_state")


def _bundled_fields(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    state = dict(state)
    for name in names:
        value = state.get(name)
        if type(value) is dict and len(value) > 1:  # what bundled() leaves as it is, asked here
            state[name] = bundled(value)
    return state


def _unbundled_fields(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    if type(state) is not dict:
        raise TypeError(f"a message's state must be a dict, got {type(state).__name__}")
    return {**state, **{name: unbundled(state[name]) for name in names if name in state}}


def _malformed_field(message: object, names: tuple[str, ...]) -> str | None:
    for name in names:
        value = getattr(message, name, None)
        if type(value) is MalformedBundle:
            return f"{name}: {value.reason}"
    return None


@dataclass
class PushPullRequest:
    """One fused push+pull from a trainer to one server.

    ``(trainer, call)`` plus the destination server is the idempotency key: a server applies the
    gradients of a key at most once and answers a duplicate without applying it again. ``call`` is
    the trainer's call number (0 is the initial pull and carries no gradients).
    """

    trainer: int
    call: int
    dense_grads: dict[str, Tensor | Encoded] = field(default_factory=dict)
    row_grads: dict[str, RowBlock] = field(default_factory=dict)
    pull_dense: bool = True
    pull_rows: dict[str, Tensor | PackedIds] = field(default_factory=dict)  # sorted unique ids
    final: bool = False
    report: TrainerReport | None = None
    pool_rows: dict[str, BagBlock] = field(default_factory=dict)
    pooled_grads: dict[str, PooledGrad] = field(default_factory=dict)
    grads_call: int = -1  # the call whose answer the gradients were computed from
    # The training step the gradients are of, for the schedule's learning rate (-1: grads_call,
    # as where every step is a call that pulls; a call carrying one of several steps computed
    # from one pull names its step: TrainConfig.steps_per_call).
    grads_step: int = -1
    # Per table, aligned with pull_rows: the version of each row the trainer has cached (-1:
    # none); the server sends only the rows that must_send picks (see row_versions).
    pull_versions: dict[str, Tensor] = field(default_factory=dict)
    # Per table, aligned with pull_rows: which rows' optimizer state to answer too (a bool
    # mask: the rows the trainer's pending update touches; see row_state).
    pull_state: dict[str, Tensor] = field(default_factory=dict)
    pull_dense_state: bool = False  # with pull_dense: the dense values' state too (dense_state)
    # The chief's sync call: every server cuts its change log once this call's round is
    # applied (so all cut at one step: paramserver.changelog.publisher).
    publish: bool = False
    # The chief trainer's buffers placed on this server that changed since its last push (all
    # of them on its final push): set as part of applying the call (ShardPlan.buffers).
    buffers: dict[str, Tensor] = field(default_factory=dict)
    # A trainer's pulls and row gradients of every table to this server, their ids packed
    # together (three tensors, not objects a table): a server turns them into pull_rows and
    # row_grads before anything reads those (RequestChecks.expand); a peer may send either.
    packed_pulls: PackedTables | None = None
    packed_grads: RowBlocks | None = None

    def drop_gradients(self) -> None:
        """Keep only the reads (a duplicate, or a push too late for its round)."""
        self.buffers.clear()
        self.dense_grads.clear()
        self.row_grads.clear()
        self.packed_grads = None
        self.pooled_grads.clear()

    @property
    def has_grads(self) -> bool:
        blocks = self.packed_grads
        packed = blocks is not None and bool(table_counts(blocks.ids.sizes.numpy()).any())
        return bool(self.dense_grads) or bool(self.row_grads) or packed or bool(self.pooled_grads)

    # On the wire, each mapping of tensors travels as one bundle (see Bundle).
    def __getstate__(self) -> dict[str, Any]:
        state = _bundled_fields(self.__dict__, _BUNDLED_REQUEST_FIELDS)
        blocks = state["row_grads"]
        if type(blocks) is dict and all(type(block) is RowBlock for block in blocks.values()):
            ids = bundled({name: block.ids for name, block in blocks.items()})
            values = bundled({name: block.values for name, block in blocks.items()})
            if type(ids) is Bundle or type(values) is Bundle:
                state["row_grads"] = RowBlocksBundle(ids, values)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(_unbundled_fields(state, _BUNDLED_REQUEST_FIELDS))
        blocks = self.__dict__.get("row_grads")
        if type(blocks) is RowBlocksBundle:  # a MalformedBundle is refused (malformed())
            self.__dict__["row_grads"] = blocks.unbundled()

    def malformed(self) -> str | None:
        """What is wrong with a bundle this request arrived with (None: nothing)."""
        blocks = self.__dict__.get("packed_grads")
        values: object = getattr(blocks, "values", None)
        if type(blocks) is RowBlocks and type(values) is MalformedBundle:
            return f"packed_grads: {values.reason}"
        return _malformed_field(self, (*_BUNDLED_REQUEST_FIELDS, "row_grads"))


def state_key(table: str, part: str) -> str:
    """The key of ``table``'s state ``part`` (a slot, ROW_STEPS or ROW_HELD) in a reply."""
    return f"{table}/{part}"


def split_state_key(key: str) -> tuple[str, str]:
    """``(table, part)`` of a :func:`state_key` (parts never hold a ``/``; tables may)."""
    table, _, part = key.rpartition("/")
    return table, part


@dataclass
class RowStateBlock:
    """The optimizer state of the rows a request's ``pull_state`` masks picked, of several
    tables whose state has the same parts (names, widths, dtypes; a rule's slots and
    ROW_STEPS) and travels by one codec: each table's rows end to end, in the request's order
    of tables (``tables``, ``counts`` of rows each), in one tensor per part. ``held`` (absent
    where every row is): which rows would take the reader's pending update (ROW_HELD)."""

    tables: tuple[str, ...]
    counts: tuple[int, ...]
    parts: dict[str, Tensor | Encoded]
    held: Tensor | None = None

    def malformed(self) -> str | None:
        """What is wrong with a peer's block, before anything of it is read (None:
        nothing)."""
        tables, counts, parts, held = self.tables, self.counts, self.parts, self.held
        if type(tables) is not tuple or not all(type(name) is str for name in tables):
            return "a row state block's tables must be a tuple of names"
        if type(counts) is not tuple or len(counts) != len(tables):
            return "a row state block must give one count per table"
        if not all(type(count) is int and count >= 0 for count in counts):
            return "a row state block's counts must be sizes"
        rows = sum(counts)
        if type(parts) is not dict or not all(type(part) is str for part in parts):
            return "a row state block's parts must be a dict by name"
        for part, value in parts.items():
            shape = value.shape if type(value) in (Tensor, Encoded) else None
            if shape is None or len(shape) == 0 or shape[0] != rows:
                return f"a row state block's part {part!r} is not one entry per row"
        if held is not None and (
            type(held) is not Tensor or held.dtype != torch.bool or held.shape != (rows,)
        ):
            return "a row state block's held rows are not one bool per row"
        return None


@dataclass
class PushPullReply:
    """A server's answer: current dense values and the requested rows, after the push applied."""

    dense: dict[str, Tensor | Encoded] = field(default_factory=dict)
    rows: dict[str, Tensor | Encoded] = field(default_factory=dict)
    pooled: dict[str, Tensor | Encoded] = field(default_factory=dict)  # [bags, dim] partial sums
    # For pull_versions' tables, per id: the version of the row the trainer holds once it has
    # this answer: the row's current version where it is sent, else the cached one echoed back.
    row_versions: dict[str, Tensor] = field(default_factory=dict)
    checkpoint_at: int = -1  # the newest checkpoint announced: its call (trainer.checkpointing)
    dense_versions: dict[str, int] = field(default_factory=dict)  # updates applied to each value
    # Asked by pull_state: the optimizer state of the rows its masks pick (sent or cached),
    # the tables of alike parts in one block each.
    row_state: list[RowStateBlock] = field(default_factory=list)
    # Asked by pull_dense_state: each dense value's slots and its count of updates (ROW_STEPS,
    # 0-d), keyed by state_key(parameter, part).
    dense_state: dict[str, Tensor | Encoded] = field(default_factory=dict)
    # This trainer's newest call that the server's change log holds for its recovery (-1:
    # none yet), the trainer keeping the later ones to send again; None: no such log.
    durable_through: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return _bundled_fields(self.__dict__, _BUNDLED_REPLY_FIELDS)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(_unbundled_fields(state, _BUNDLED_REPLY_FIELDS))

    def malformed(self) -> str | None:
        """What is wrong with a bundle or a row state block this answer arrived with (None:
        nothing)."""
        blocks = self.row_state
        if type(blocks) is not list or not all(type(b) is RowStateBlock for b in blocks):
            return "row_state: not a list of row state blocks"
        for block in blocks:
            problem = block.malformed()
            if problem is not None:
                return f"row_state: {problem}"
        return _malformed_field(self, _BUNDLED_REPLY_FIELDS)


@dataclass
class ServerView:
    """A server's answer for one dense parameter in a replica check (``dense_check``)."""

    version: int
    checksum: str
    value: Tensor | None  # sent only when the checksums differ
