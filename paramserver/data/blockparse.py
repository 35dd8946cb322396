"""A block of click-log lines parsed in one go: numpy finds the fields and converts whole
columns, with no Python work per line or per field.

The lines are those of :mod:`paramserver.data.criteo`: tab-separated, a label ``0`` or ``1``,
then ``num_ints`` decimal integers (``-?[0-9]{1,18}``) and ``num_hex`` hex strings
(``[0-9a-fA-F]{1,8}``), any of these possibly empty; lines end in ``\\n`` or ``\\r\\n``, and
empty lines are skipped. :func:`parse_block` accepts exactly the blocks whose every line is of
that form and returns what a line-by-line parser would; for any other block it returns None
and the caller parses that block line by line, to name its first bad line (or, for a good
line this parser leaves to it, such as one ending in ``\\r\\r\\n``, to read it anyway). So this
module decides nothing about what a line means, only how fast a block is read.

The steps, each an operation on a whole array:

1. Every byte must be one a good line may hold (hex digits, ``-``, tab, ``\\r``, ``\\n``).
2. Fields: the positions of the tabs and newlines; each line must have ``num_fields - 1`` tabs
   then its newline. Where the block has none but such lines, the separators' positions
   reshaped to ``[lines, num_fields]`` are the fields' ends, and each field starts after the
   separator before it; lines without a tab must be empty (they are skipped).
3. Each field of at most 8 bytes is read as one unaligned 8-byte word at its start, its bytes
   turned big-endian and shifted right so that the field's last byte is the lowest
   (:func:`_right_aligned`); the bytes after the field drop out.
4. Such a word is converted with shifts, masks and multiplies on all fields at once (SWAR: each
   byte a lane): hex digits become 4-bit values (``(c & 0xF) + 9 * (c >> 6)``) packed into 32
   bits; decimal digits are checked to be ``0-9`` and combined as ``10 * high + low`` in
   lanes of 2, 4 then 8 digits. An integer's leading ``-`` is replaced by ``0`` and the value
   negated. Integers of 9 to 19 bytes (rare) are read one by one by ``int()``.

Thread-safety: no shared state; numpy releases the GIL in the heavy steps, so a block is parsed
alongside other Python threads (training) most of the time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import re
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

WORD = 8  # bytes read at once; the longest hex field
_UINT = np.uint64
_ONES = 0x0101010101010101  # one in each byte lane
_LONG_INT = re.compile(rb"-?[0-9]{1,18}")  # 9 to 19 bytes: read one by one
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)


@dataclass(frozen=True)
class Columns:
    """A block's lines as arrays: ``labels`` float32 ``[n]``; ``ints`` int64 ``[n, num_ints]``
    (0 where empty); ``hex_values`` uint64 ``[n, num_hex]`` (``missing`` where empty). The
    arrays are the caller's."""

    labels: np.ndarray
    ints: np.ndarray
    hex_values: np.ndarray


def parse_block(data: bytes, num_ints: int, num_hex: int, missing: int) -> Columns | None:
    """The lines of ``data`` (whole lines) as columns, or None where a line is not of the form
    above or is one left to a line-by-line parser (see the module docstring)."""
    if not data.endswith(b"\n"):  # a file's last line, without its ending
        data += b"\n"
    text = np.frombuffer(data, np.uint8)
    if not _allowed_bytes(text):
        return None
    fields = _fields(text, 1 + num_ints + num_hex, b"\r" in data)
    if fields is None:
        return None
    starts, lengths = fields
    words = _words(text)
    labels = _labels(text, starts[:, 0], lengths[:, 0])
    ints = _ints(text, words, starts[:, 1 : 1 + num_ints], lengths[:, 1 : 1 + num_ints])
    hex_values = _hex_values(words, starts[:, 1 + num_ints :], lengths[:, 1 + num_ints :])
    if labels is None or ints is None or hex_values is None:
        return None
    hex_values[lengths[:, 1 + num_ints :] == 0] = missing
    return Columns(labels, ints, hex_values)


@functools.cache  # once per process
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse rather than hand it back to the OS at
    once: blocks of up to 32 MiB come from the heap (``M_MMAP_THRESHOLD``) and up to 64 MiB
    of free memory stays at its top (``M_TRIM_THRESHOLD``). False where the C library has no
    ``mallopt`` (not glibc): nothing changes there.

    Why: parsing a block allocates a few arrays of several MiB. With glibc's defaults they
    are mapped afresh for every block, and faulting their pages in cost more than the parsing
    itself (measured: half a page a line at about 2 us a page, on a 2 us line; with these
    settings, none). The price: the process keeps up to 64 MiB of freed memory per malloc
    arena, so its peak RSS can be that much higher. Process-wide, and set once.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to load, or no mallopt in it
        return False
    kept = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and mallopt(_M_TRIM_THRESHOLD, 64 << 20) == 1
    log.debug("malloc keeps freed memory for reuse: %s", kept)
    return kept


def _allowed_bytes(text: np.ndarray) -> bool:
    """Whether every byte is a hex digit, ``-``, a tab, ``\\r`` or ``\\n``."""
    scratch = text - np.uint8(ord("0"))  # wraps: bytes below "0" become large
    allowed = scratch < 10
    np.bitwise_or(text, np.uint8(0x20), out=scratch)
    scratch -= np.uint8(ord("a"))
    allowed |= scratch < 6
    np.subtract(text, np.uint8(ord("\t")), out=scratch)
    allowed |= scratch < 2  # tab, newline
    np.bitwise_and(text, np.uint8(0xDF), out=scratch)
    allowed |= scratch == ord("\r")  # "\r" (0x0D) or "-" (0x2D)
    return bool(allowed.all())


def _fields(
    text: np.ndarray, num_fields: int, has_returns: bool
) -> tuple[np.ndarray, np.ndarray] | None:
    """Every line's fields as ``(starts, lengths)``, int64 ``[lines, num_fields]``, empty
    lines skipped and a ``\\r`` before a newline dropped; None unless every other line has
    ``num_fields`` fields."""
    ends = np.flatnonzero(text <= ord("\n"))  # tabs and newlines: no other byte is that low
    starts = np.empty_like(ends)
    starts[0] = 0
    np.add(ends[:-1], 1, out=starts[1:])
    newlines = np.count_nonzero(text == ord("\n"))
    last = ends[num_fields - 1 :: num_fields]
    if len(ends) != newlines * num_fields or not (text[last] == ord("\n")).all():
        found = _skip_empty_lines(text, starts, ends, num_fields)
        if found is None:
            return None
        starts, ends = found
    field_starts, field_ends = starts.reshape(-1, num_fields), ends.reshape(-1, num_fields)
    if has_returns:  # "\r\n": the last field ends before the "\r"
        field_ends[:, -1] -= text[field_ends[:, -1] - 1] == ord("\r")
    return field_starts, field_ends - field_starts


def _skip_empty_lines(
    text: np.ndarray, starts: np.ndarray, ends: np.ndarray, num_fields: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """The fields' starts and ends without the lines that have no tab, if those are empty
    (nothing or ``\\r``); None unless every line left has ``num_fields`` fields."""
    newline = text[ends] == ord("\n")
    alone = newline.copy()  # a newline right after a newline, or first: a line without tabs
    alone[1:] &= newline[:-1]
    size = ends[alone] - starts[alone]
    if not ((size == 0) | ((size == 1) & (text[starts[alone]] == ord("\r")))).all():
        return None
    kept = ~alone
    starts, ends, newline = starts[kept], ends[kept], newline[kept]
    if len(ends) % num_fields or not newline[num_fields - 1 :: num_fields].all():
        return None
    if np.count_nonzero(newline) * num_fields != len(ends):
        return None
    return starts, ends


def _words(text: np.ndarray) -> np.ndarray:
    """Every 8-byte window of ``text`` (zero-padded) as a little-endian uint64, one per start
    byte: an unaligned view, gathered from by field starts."""
    padded = np.zeros(len(text) + WORD, np.uint8)
    padded[: len(text)] = text
    return np.ndarray((len(text),), dtype="<u8", buffer=padded, strides=(1,))


def _right_aligned(words: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Fields of at most 8 bytes as uint64: the first byte highest, the last byte lowest, zero
    bytes above (0 for an empty field)."""
    values = words[starts]
    values.byteswap(inplace=True)
    values >>= (8 * (WORD - lengths)).astype(_UINT)  # numpy's uint64 >> 64 is 0
    return values


def _labels(text: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    first = text[starts]
    if not ((lengths == 1) & ((first | 1) == ord("1"))).all():
        return None
    return (first - ord("0")).astype(np.float32)


def _hex_values(words: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """Hex fields ``[n, k]`` as uint64 ``[n, k]`` (garbage where empty); None unless each is
    1 to 8 hex digits or empty."""
    if (lengths > WORD).any():
        return None
    values = _right_aligned(words, starts, lengths)
    # The allowed bytes that are not hex digits, "-" and "\r", are those whose bits but 0x20
    # are 0x0D. The zero bytes above a field are not.
    if _has_byte(values & _UINT(0xDF * _ONES), ord("\r")):
        return None
    digits = (values >> _UINT(6)) & _UINT(_ONES)
    digits *= _UINT(9)
    values &= _UINT(0x0F * _ONES)
    values += digits  # each byte its digit's value: 0-15
    _combine_digits(values, 16)
    return values


def _has_byte(values: np.ndarray, byte: int) -> bool:
    """Whether any byte of any word is ``byte`` (SWAR: a zero byte of ``value ^ byte``)."""
    x = values ^ _UINT(byte * _ONES)
    return bool(((x - _UINT(_ONES)) & ~x & _UINT(0x80 * _ONES)).any())


def _combine_digits(values: np.ndarray, base: int) -> None:
    """Words of 8 digit values in ``base`` (at most 16), one per byte, the most significant
    highest, turned in place into the numbers they spell: lanes of 2, 4 then 8 digits, each
    ``high * base**k + low`` (never past the lane's bits, so no lane spills into the next)."""
    scratch = np.empty_like(values)
    for shift, mask in ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0xFFFFFFFF)):
        np.right_shift(values, _UINT(shift), out=scratch)
        scratch *= _UINT(base ** (shift // 8))
        values += scratch
        values &= _UINT(mask)


def _ints(
    text: np.ndarray, words: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> np.ndarray | None:
    """Integer fields ``[n, k]`` as int64 ``[n, k]`` (0 where empty); None unless each is
    ``-?[0-9]{1,18}`` or empty."""
    negative = text[starts] == ord("-")  # an empty field "starts" at the separator after it
    digits_start, digit_count = starts + negative, lengths - negative
    if ((digit_count == 0) & negative).any():  # "-" alone
        return None
    values = _right_aligned(words, digits_start, np.minimum(digit_count, WORD))
    if _has_non_digit(values):
        return None
    values &= _UINT(0x0F * _ONES)  # each byte its digit's value; the zero bytes above stay 0
    _combine_digits(values, 10)
    signed = values.view(np.int64)
    np.negative(signed, out=signed, where=negative)
    long = np.flatnonzero(lengths > WORD)
    return signed if not len(long) else _read_long(signed, text, starts, lengths, long)


def _has_non_digit(values: np.ndarray) -> bool:
    """Whether any byte is neither a decimal digit nor zero. Bytes are below 0x80 (allowed
    ones), so adding 0x46, 0x50 or 0x7F to each sets its top bit, without a carry into the
    next, exactly when it is past "9", from "0" on, or not zero."""
    past_9 = values + _UINT(0x46 * _ONES)
    from_0 = values + _UINT(0x50 * _ONES)
    not_zero = values + _UINT(0x7F * _ONES)
    past_9 |= not_zero & ~from_0
    return bool((past_9 & _UINT(0x80 * _ONES)).any())


def _read_long(
    values: np.ndarray, text: np.ndarray, starts: np.ndarray, lengths: np.ndarray, long: np.ndarray
) -> np.ndarray | None:
    """``values`` with the integers of 9 bytes or more (at flat indices ``long``) read by
    ``int()``; None unless each is ``-?[0-9]{1,18}``."""
    flat, flat_starts, flat_lengths = values.reshape(-1), starts.reshape(-1), lengths.reshape(-1)
    for i in long.tolist():
        field = text[flat_starts[i] : flat_starts[i] + flat_lengths[i]].tobytes()
        if _LONG_INT.fullmatch(field) is None:
            return None
        flat[i] = int(field)
    return values
