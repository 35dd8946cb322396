"""Messages between trainers and servers.

A trainer sends each server one :class:`PushPullRequest` per training step, each numbered
call ``0, 1, 2, ...`` (call 0 is the initial pull): the gradients of its last step go up and
the values it needs for the next step come back in the same round trip (:class:`PushPullReply`).
Words kept apart: a *call* is that number; a parameter's or row's *version* is how many updates
the server applied to it; *step* is a trainer's training step (and, in the optimizer, its per-row
step count); a checkpoint's *step* is the call number at which it was saved.

Row ids on the wire are *global* row ids of a table; each server owns the rows the routing rule
gives it (see :mod:`paramserver.sharding`). The sorted unique ids of a push's rows and of a pull
travel compactly, as a plain int64 tensor or a :class:`~paramserver.idcodec.PackedIds` (see
:mod:`paramserver.idcodec`); a server validates and unpacks them before anything else of the
request is decoded.

Any float32 tensor of gradients or values may travel encoded (a
:class:`~paramserver.compression.Encoded`, per the job's codecs); the receiver decodes it, and a
server validates it first.

On the wire (pickled, as the RPC transport sends them), each of a message's mappings of plain
tensors of one dtype (gradients, ids, rows, versions) travels as one
:class:`~paramserver.bundles.Bundle`: TensorPipe ships every tensor as a buffer of its own, at a
cost per tensor that a step with many tables would pay a hundred times. The receiver gets views
of the bundle, after checking it whole; a malformed one leaves a
:class:`~paramserver.bundles.MalformedBundle` that ``malformed()`` reports.

A trainer's :class:`TrainerReport` (sent with its last call) carries its per-operation call
statistics (:class:`CallStats`) and the summary of its replica checks; :class:`ServerView` is a
server's answer to one such check. Latencies go into fixed logarithmic buckets (16 per decade,
from 10 us to 1,000 s), so trainers' statistics merge by adding counts and percentiles are read
off the merged histogram: a percentile is reported as its bucket's geometric middle, within 8%
of the true value.

Ownership: once a message is handed to a transport the sender must not modify its tensors; the
receiver owns what it receives.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from paramserver.bundles import Bundle, MalformedBundle, bundled, unbundled
from paramserver.compression import Encoded
from paramserver.idcodec import FIRST_NBYTES, PackedIds, num_ids


@dataclass
class RowBlock:
    """Rows of one table: ``ids`` holds sorted unique global row ids (1-D int64, or packed on
    the wire), ``values`` the matching ``[len(ids), dim]`` rows (gradients in a request,
    parameters in a reply)."""

    ids: Tensor | PackedIds
    values: Tensor | Encoded


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


BUCKETS_PER_DECADE = 16
SMALLEST_S = 1e-5
NUM_BUCKETS = 8 * BUCKETS_PER_DECADE + 2  # one below 10 us, one at or above 1,000 s


def bucket_of(seconds: float) -> int:
    if seconds < SMALLEST_S:
        return 0
    index = 1 + int(math.log10(seconds / SMALLEST_S) * BUCKETS_PER_DECADE)
    return min(index, NUM_BUCKETS - 1)


def bucket_middle(index: int) -> float:
    """The geometric middle of bucket ``index``, in seconds."""
    if index == 0:
        return SMALLEST_S / 2
    return SMALLEST_S * 10 ** ((index - 0.5) / BUCKETS_PER_DECADE)


@dataclass
class CallStats:
    """One operation's calls (as a trainer made them); travels in the trainer's report."""

    calls: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    max_s: float = 0.0
    histogram: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.max_s = max(self.max_s, seconds)
        self.histogram[bucket_of(seconds)] += 1

    def merge(self, other: CallStats) -> None:
        self.calls += other.calls
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.max_s = max(self.max_s, other.max_s)
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram, strict=True)]

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile latency in seconds (0 without calls)."""
        timed = sum(self.histogram)
        if not timed:
            return 0.0
        rank = max(1, math.ceil(q / 100 * timed))
        seen = 0
        for index, count in enumerate(self.histogram):
            seen += count
            if seen >= rank:
                return min(bucket_middle(index), self.max_s)
        return self.max_s

    def is_well_formed(self) -> bool:
        return (
            all(type(v) is int and v >= 0 for v in (self.calls, self.sent_bytes))
            and type(self.received_bytes) is int
            and self.received_bytes >= 0
            and type(self.max_s) is float
            and math.isfinite(self.max_s)
            and type(self.histogram) is list
            and len(self.histogram) == NUM_BUCKETS
            and all(type(c) is int and c >= 0 for c in self.histogram)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "p50_ms": self.percentile(50) * 1e3,
            "p90_ms": self.percentile(90) * 1e3,
            "p99_ms": self.percentile(99) * 1e3,
            "max_ms": self.max_s * 1e3,
        }


CONSISTENCY_KEYS = frozenset(  # of a trainer's replica-check summary (observe.consistency)
    {
        "checks",
        "versions_behind_max",
        "versions_behind_mean",
        "max_abs_diff",
        "rel_l2_diff_max",
        "differing_at_same_version",
    }
)


@dataclass
class TrainerReport:
    """What a trainer tells the servers when it leaves, for the job summary.

    Its counts and times cover this run: what the trainer did since it started or, after
    ``--resume`` (or a restart), since the checkpoint it resumed from; ``resumed_*`` say where
    that was.
    """

    trainer: int
    steps: int
    samples: int
    train_loss: float
    train_seconds: float
    bytes_sent: int
    bytes_received: int
    uncompressed_bytes_sent: int = 0  # what the same messages would be without codecs
    uncompressed_bytes_received: int = 0
    row_bytes_received: int = 0  # embedding rows alone
    cache_hits: int = 0  # rows served from the trainer's cache...
    cache_lookups: int = 0  # ...of the rows its steps needed from cached tables
    peak_rss_bytes: int = 0  # the trainer process's peak resident memory
    input_bytes: int | None = None  # bytes of input its data read; None: the data does not say
    calls: dict[str, CallStats] = field(default_factory=dict)  # by operation
    consistency: dict[str, float] = field(default_factory=dict)  # replica checks, if any
    resumed_at: int = -1  # the step of the checkpoint this run resumed from; -1: from the start
    resumed_steps: int = 0  # the steps and samples this trainer had done by that checkpoint
    resumed_samples: int = 0

    def is_well_formed(self) -> bool:
        ints = (
            self.trainer,
            self.steps,
            self.samples,
            self.bytes_sent,
            self.bytes_received,
            self.uncompressed_bytes_sent,
            self.uncompressed_bytes_received,
            self.row_bytes_received,
            self.cache_hits,
            self.cache_lookups,
            self.peak_rss_bytes,
            self.resumed_at,
            self.resumed_steps,
            self.resumed_samples,
        )
        floats = (self.train_loss, self.train_seconds)
        return (
            all(type(v) is int for v in ints)
            and (self.input_bytes is None or type(self.input_bytes) is int)
            and all(type(v) is float for v in floats)
            and type(self.calls) is dict
            and all(
                type(op) is str and type(c) is CallStats and c.is_well_formed()
                for op, c in self.calls.items()
            )
            and type(self.consistency) is dict
            and (not self.consistency or set(self.consistency) == CONSISTENCY_KEYS)
            and all(type(v) in (int, float) for v in self.consistency.values())
        )


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
_BUNDLED_REPLY_FIELDS = ("dense", "rows", "pooled", "row_versions", "row_state", "dense_state")


def _bundled_fields(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    state = dict(state)
    for name in names:
        state[name] = bundled(state.get(name))
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

    def drop_gradients(self) -> None:
        """Keep only the reads (a duplicate, or a push too late for its round)."""
        self.dense_grads.clear()
        self.row_grads.clear()
        self.pooled_grads.clear()

    @property
    def has_grads(self) -> bool:
        return bool(self.dense_grads) or bool(self.row_grads) or bool(self.pooled_grads)

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
        return _malformed_field(self, (*_BUNDLED_REQUEST_FIELDS, "row_grads"))


def state_key(table: str, part: str) -> str:
    """The key of ``table``'s state ``part`` (a slot, ROW_STEPS or ROW_HELD) in a reply."""
    return f"{table}/{part}"


def split_state_key(key: str) -> tuple[str, str]:
    """``(table, part)`` of a :func:`state_key` (parts never hold a ``/``; tables may)."""
    table, _, part = key.rpartition("/")
    return table, part


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
    # keyed by state_key(table, part), in their order; the parts: a rule's slots, ROW_STEPS,
    # ROW_HELD.
    row_state: dict[str, Tensor] = field(default_factory=dict)
    # Asked by pull_dense_state: each dense value's slots and its count of updates (ROW_STEPS,
    # 0-d), keyed by state_key(parameter, part).
    dense_state: dict[str, Tensor] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        return _bundled_fields(self.__dict__, _BUNDLED_REPLY_FIELDS)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(_unbundled_fields(state, _BUNDLED_REPLY_FIELDS))

    def malformed(self) -> str | None:
        """What is wrong with a bundle this answer arrived with (None: nothing)."""
        return _malformed_field(self, _BUNDLED_REPLY_FIELDS)


@dataclass
class ServerView:
    """A server's answer for one dense parameter in a replica check (``dense_check``)."""

    version: int
    checksum: str
    value: Tensor | None  # sent only when the checksums differ


def must_send(cached: Tensor, current: Tensor, bound: int) -> Tensor:
    """Which rows a server sends a trainer that caches: those it has not cached, those without
    a row (their default vector is not cached), and those more than ``bound`` (>= 0) updates
    behind. Decided by the server alone: the trainer reads it off the answer (:func:`rows_sent`)."""
    return (cached < 0) | (current < 0) | (current - cached > bound)


def rows_sent(cached: Tensor, held: Tensor) -> Tensor:
    """Which rows an answer carries, read off the versions it holds (``row_versions``): a row
    the trainer had not cached, or whose version changed. Those :func:`must_send` picks, without
    its bound: a cached row sent is missing (-1) or over ``bound >= 0`` updates newer, so its
    version differs from the cached one; a row not sent comes back with the cached version."""
    return (cached < 0) | (held != cached)


@dataclass(frozen=True)
class PayloadSize:
    """Bytes of tensor data in a message (see :func:`payload_size`)."""

    nbytes: int  # as it travels: an encoded tensor by its payload, packed ids as packed
    uncompressed_nbytes: int  # each encoded tensor counted as the float32 tensor it stands for
    # (packed ids count as they travel: packing is the wire format, not a codec)


_LEAVES = frozenset({int, float, bool, str, bytes, type(None)})  # hold no tensor data


def payload_size(message: Any) -> PayloadSize:
    """Bytes of tensor data in a message, as sent and uncompressed, in one walk (dataclasses,
    mappings and sequences are walked).

    This is what dominates the wire: TensorPipe ships tensor storage as separate buffers; the
    pickled skeleton around them is a few hundred bytes per call and is not counted.
    """
    return PayloadSize(*_payload_nbytes(message))


def payload_nbytes(message: Any) -> int:
    """:attr:`PayloadSize.nbytes` of a message: its tensor data as sent."""
    return _payload_nbytes(message)[0]


def _payload_nbytes(message: Any) -> tuple[int, int]:
    if type(message) in _LEAVES:  # most fields: settled before the checks below
        return 0, 0
    if isinstance(message, Tensor):
        nbytes = message.numel() * message.element_size()
        return nbytes, nbytes
    if isinstance(message, Encoded):
        return _payload_nbytes(message.tensors)[0], math.prod(message.shape) * 4
    if isinstance(message, PackedIds):
        return message.nbytes, message.nbytes
    if type(message) is dict or isinstance(message, Mapping):  # the ABC's check costs more
        parts: Any = message.values()
    elif isinstance(message, list | tuple):
        parts = message
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        parts = [getattr(message, name) for name in _field_names(type(message))]
    else:
        return 0, 0
    sent = uncompressed = 0
    for part in parts:
        part_sent, part_uncompressed = _payload_nbytes(part)
        sent += part_sent
        uncompressed += part_uncompressed
    return sent, uncompressed


class MessageSizes(NamedTuple):
    """A peer's message measured for a server (see :func:`message_sizes`)."""

    held: int  # at most what it holds once decoded
    sent: int  # its tensor data as sent (:func:`payload_nbytes` of a well-formed message)


def message_nbytes(message: Any) -> int:
    """:attr:`MessageSizes.held` of a peer's message (see :func:`message_sizes`)."""
    return message_sizes(message).held


def message_sizes(message: Any) -> MessageSizes:
    """A peer's message measured in one walk: an upper bound on the memory it holds once
    decoded, for a server's size cap, and its tensor data as sent, for the server's traffic
    figures.

    ``held`` counts every tensor's data (all ``numel`` elements, even when they share storage),
    each encoded tensor's payload plus the float32 tensor its shape claims (``none`` decodes to
    its payload), packed ids' payload plus the int64 ids they unpack to, and strings and bytes by
    length. ``sent`` counts tensor data alone (and a packed ``first`` id as 8 bytes); an object
    reached twice counts once in both (a well-formed message shares none).

    Never raises and does not recurse, whatever the message: a peer's may hold cycles, deep
    nesting or a claimed shape of absurd size.
    """
    held = sent = 0
    pending = [message]
    seen: set[int] = set()  # objects reached twice (shared, or in a cycle) count once
    kinds = _KINDS
    while pending:
        item = pending.pop()
        cls: type = type(item)
        kind = kinds.get(cls) or _remembered_kind(cls)
        if kind is _Kind.OTHER:  # counts nothing, reached once or more
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if kind is _Kind.TENSOR:
            nbytes = item.numel() * item.element_size()
            held += nbytes
            sent += nbytes
        elif kind is _Kind.DICT:
            pending += item.keys()
            pending += item.values()
        elif kind is _Kind.DATACLASS:
            pending += [getattr(item, name, None) for name in _field_names(cls)]
        elif kind is _Kind.TEXT:
            held += len(item)
        elif kind is _Kind.ENCODED:
            if getattr(item, "codec", None) != "none":
                held += _claimed_nbytes(getattr(item, "shape", None))
            pending.append(getattr(item, "tensors", None))
        elif kind is _Kind.PACKED:
            held += FIRST_NBYTES + num_ids(item) * 8
            sent += FIRST_NBYTES
            pending.append(getattr(item, "steps", None))
        elif kind is _Kind.COLLECTION:
            pending.extend(item)
    return MessageSizes(held, sent)


class _Kind(enum.Enum):
    """What :func:`message_sizes` does with an object, by its type."""

    TENSOR = enum.auto()
    TEXT = enum.auto()
    ENCODED = enum.auto()
    PACKED = enum.auto()
    DATACLASS = enum.auto()
    DICT = enum.auto()
    COLLECTION = enum.auto()
    OTHER = enum.auto()


_KINDS: dict[type, _Kind] = {}  # each type's kind, found once (a message holds a few types,
# walked many times each: one lookup per object, not a chain of isinstance checks)
_MAX_KINDS = 1024


def _remembered_kind(cls: type) -> _Kind:
    """:func:`_kind`, kept in :data:`_KINDS` (bounded: the types a peer can name are the
    process's)."""
    kind = _kind(cls)
    if len(_KINDS) < _MAX_KINDS:
        _KINDS[cls] = kind
    return kind


def _kind(cls: type) -> _Kind:
    """The kind of objects of type ``cls``."""
    if issubclass(cls, Tensor):
        return _Kind.TENSOR
    if issubclass(cls, str | bytes | bytearray):
        return _Kind.TEXT
    if issubclass(cls, Encoded):
        return _Kind.ENCODED
    if issubclass(cls, PackedIds):
        return _Kind.PACKED
    if dataclasses.is_dataclass(cls) and not issubclass(cls, type):  # an instance's type
        return _Kind.DATACLASS
    if issubclass(cls, dict):
        return _Kind.DICT
    if issubclass(cls, list | tuple | set | frozenset):
        return _Kind.COLLECTION
    return _Kind.OTHER


def _claimed_nbytes(shape: object) -> int:
    """Bytes of the float32 tensor an encoded ``shape`` claims; 0 for a malformed shape (the
    server refuses it before decoding) and at most 2^62."""
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        return 0
    if 0 in shape:
        return 0
    nbytes = 4
    for dim in shape:
        nbytes *= dim
        if nbytes > 2**62:  # stop early: a product of many huge claims is slow to compute
            return 2**62
    return nbytes


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """The fields of a dataclass (``dataclasses.fields`` rebuilds them at every call: slow
    for walks over every message)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def clone_message(message: Any) -> Any:
    """A deep copy whose tensors share nothing with the original (an in-process 'wire')."""
    if isinstance(message, Tensor):
        return message.clone()
    if dataclasses.is_dataclass(message) and not isinstance(message, type):
        return dataclasses.replace(
            message,
            **{name: clone_message(getattr(message, name)) for name in _field_names(type(message))},
        )
    if isinstance(message, dict):
        return {k: clone_message(v) for k, v in message.items()}
    if isinstance(message, list):
        return [clone_message(v) for v in message]
    if isinstance(message, tuple):
        return tuple(clone_message(v) for v in message)
    return message
