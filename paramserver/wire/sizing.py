"""Messages measured and copied by walking them: the bytes a message carries as sent and
uncompressed (:func:`payload_size`), what it would hold once decoded (:func:`message_sizes`,
the server's cap), and a deep copy (:func:`clone_message`, the in-process transport's)."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from paramserver import native_frames
from paramserver.wire.compression import Encoded
from paramserver.wire.idcodec import FIRST_NBYTES, PackedIds, num_ids


@dataclass(frozen=True)
class PayloadSize:
    """Bytes of tensor data in a message (see :func:`payload_size`)."""

    nbytes: int  # as it travels: an encoded tensor by its payload, packed ids as packed
    uncompressed_nbytes: int  # each encoded tensor counted as the float32 tensor it stands for
    # (packed ids count as they travel: packing is the wire format, not a codec)


_LEAVES = frozenset({int, float, bool, str, bytes, type(None)})  # hold no tensor data


def payload_size(message: Any) -> PayloadSize:
    """Bytes of tensor data in a message, as sent and uncompressed, in one walk (dataclasses,
    mappings and sequences are walked; by the compiled loops where they take tensors).

    This is what dominates the wire: TensorPipe ships tensor storage as separate buffers; the
    pickled skeleton around them is a few hundred bytes per call and is not counted.
    """
    return PayloadSize(
        *native_frames.payload_sizes(message, _SPECIAL, _field_names, _payload_nbytes)
    )


def payload_nbytes(message: Any) -> int:
    """:attr:`PayloadSize.nbytes` of a message: its tensor data as sent."""
    return native_frames.payload_sizes(message, _SPECIAL, _field_names, _payload_nbytes)[0]


def _encoded_sizes(encoded: Encoded) -> tuple[int, int]:
    """An encoded tensor's payload, and the float32 tensor its shape claims (a peer's
    malformed claim: 0, an absurd one: at most 2^62)."""
    payload = _payload_nbytes(getattr(encoded, "tensors", None))[0]
    return payload, _claimed_nbytes(getattr(encoded, "shape", None))


def _packed_sizes(packed: PackedIds) -> tuple[int, int]:
    """Packed ids as they travel: their steps and the first id (a peer's steps that are not
    a tensor: none)."""
    nbytes = FIRST_NBYTES + _payload_nbytes(getattr(packed, "steps", None))[0]
    return nbytes, nbytes


# Counted as a whole, by type: an encoded tensor by its payload and the float32 tensor it
# stands for; packed ids as they travel (packing is the wire format, not a codec).
_SPECIAL: dict[type, Callable[[Any], tuple[int, int]]] = {
    Encoded: _encoded_sizes,
    PackedIds: _packed_sizes,
}


def _payload_nbytes(message: Any) -> tuple[int, int]:
    """:func:`payload_size` in Python: where the loops do not take tensors, or a count
    passes int64."""
    if type(message) in _LEAVES:  # most fields: settled before the checks below
        return 0, 0
    if isinstance(message, Tensor):
        nbytes = message.numel() * message.element_size()
        return nbytes, nbytes
    special = _SPECIAL.get(type(message))
    if special is not None:
        return special(message)
    if isinstance(message, dict | list | tuple):
        parts: Any = message.values() if isinstance(message, dict) else message
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        parts = [getattr(message, name) for name in _field_names(type(message))]
    elif isinstance(message, Mapping):
        parts = message.values()
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
            part_held, part_sent = _mapping_sizes(item, seen, pending)
            held += part_held
            sent += part_sent
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


def _mapping_sizes(mapping: dict, seen: set[int], pending: list[Any]) -> tuple[int, int]:
    """:func:`message_sizes` of a mapping's plain names and tensors (most of a message),
    counted here, not walked one by one; its other keys and values are left in ``pending``."""
    held = sent = 0
    for part in (*mapping.keys(), *mapping.values()):
        part_type = type(part)
        if part_type is not str and part_type is not Tensor:
            pending.append(part)
        elif id(part) not in seen:
            seen.add(id(part))
            if part_type is str:
                held += len(part)
            else:
                nbytes = part.numel() * part.element_size()
                held += nbytes
                sent += nbytes
    return held, sent


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
