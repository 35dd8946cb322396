"""The optimizer state of prefetched rows, as a trainer's own update takes it
(:mod:`paramserver.trainer.ownupdates`): every table's rows end to end (:class:`RowStates`),
joined from the servers' answers (:func:`joined_state`) in a few array operations, not a pass
per table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from paramserver.errors import ParamServerError
from paramserver.trainer.routes import Route
from paramserver.wire.compression import plain
from paramserver.wire.messages import PushPullReply, RowStateBlock


@dataclass
class RowState:
    """Optimizer state of some of a pulled table's rows: ``at``, their places among its ids,
    and ``parts``, by part (its rule's slots and ROW_STEPS), aligned with ``at``."""

    at: Tensor
    parts: dict[str, Tensor]


@dataclass
class RowStates:
    """Optimizer state of the pulled rows of several tables (``names``; a table answered by
    several servers appears once for each) that take the pending update, end to end: ``at``,
    each row's place among its table's pulled ids (int64), and ``parts`` (the same for each
    table: its rule's slots and ROW_STEPS) aligned with ``at``; table ``j``'s rows from
    ``spans[j, 0]`` to ``spans[j, 1]``."""

    names: list[str]
    at: np.ndarray | None
    spans: np.ndarray | None
    parts: dict[str, Tensor]
    # at and spans None: every pulled row of each table, in order, with no state (a rule that
    # reads none); counts: then how many rows each table pulled.
    counts: list[int] | None = None

    @classmethod
    def every_row(cls, names: list[str], counts: list[int]) -> RowStates:
        """Every pulled row of tables ``names`` (``counts`` of them each), with no state."""
        return cls(names, None, None, {}, counts)

    def table(self, j: int) -> RowState:
        """Table ``j``'s rows, as views (what is stepped in them is stepped here)."""
        if self.at is None or self.spans is None:
            assert self.counts is not None
            return RowState(torch.arange(self.counts[j]), {})
        begin, end = (int(x) for x in self.spans[j])
        at = torch.from_numpy(self.at[begin:end])
        return RowState(at, {part: value[begin:end] for part, value in self.parts.items()})

    @classmethod
    def joined(cls, each: Sequence[RowStates]) -> RowStates:
        """The rows of ``each`` (of alike parts, each with its places) after one another."""
        ats, spans = [], []
        for rows in each:
            assert rows.at is not None and rows.spans is not None
            ats.append(rows.at)
            spans.append(rows.spans)
        offsets = np.cumsum([0] + [at.size for at in ats[:-1]])
        return cls(
            [name for rows in each for name in rows.names],
            np.concatenate(ats),
            np.concatenate([span + offset for span, offset in zip(spans, offsets, strict=True)]),
            {part: torch.cat([rows.parts[part] for rows in each]) for part in each[0].parts},
        )


class StateMasks(dict[str, Tensor]):
    """Per table, a bool mask of its pulled ids: the rows whose state a prefetch asks;
    ``found``: every table's end to end in the dict's order, where they were made so (the
    masks then views of it)."""

    found: np.ndarray | None = None


def places_of(found: np.ndarray, sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The places of ``found``'s true entries (a bool mask of several tables' ids end to end,
    ``sizes`` of each), each among its table's ids: ``(at, spans)`` as :class:`RowStates`
    holds them."""
    ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
    starts = ends - np.asarray(sizes, dtype=np.int64)
    places = np.flatnonzero(found)
    spans = np.stack([np.searchsorted(places, starts), np.searchsorted(places, ends)], axis=1)
    return places - np.repeat(starts, spans[:, 1] - spans[:, 0]), spans


def joined_state(
    replies: Sequence[PushPullReply], masks: Mapping[str, Tensor], routes: Mapping[str, Route]
) -> list[RowStates]:
    """The state the servers sent (``replies``, in server order) of the rows ``masks`` picked
    (per table, of its ids as ``routes`` split them), of those that take the pending update:
    the tables whose state has alike parts together, every server's rows after the one
    before's. Raises ParamServerError where an answer is not of the rows asked."""
    joined: dict[tuple[object, ...], list[RowStates]] = {}
    for server, reply in enumerate(replies):
        answered: list[str] = []
        for block in reply.row_state:
            rows = _block_rows(server, len(replies), block, masks, routes)
            kinds = tuple((p, v.shape[1:], v.dtype) for p, v in rows.parts.items())
            joined.setdefault(kinds, []).append(rows)
            answered.extend(block.tables)
        if len(answered) != len(masks) or set(answered) != masks.keys():
            raise ParamServerError(
                f"server {server} sent a malformed answer: its row state is not of the "
                "tables asked, each once"
            )
    return [rows[0] if len(rows) == 1 else RowStates.joined(rows) for rows in joined.values()]


def _block_rows(
    server: int,
    servers: int,
    block: RowStateBlock,
    masks: Mapping[str, Tensor],
    routes: Mapping[str, Route],
) -> RowStates:
    """One server's block as :class:`RowStates`: each row's place among its table's ids
    (the masks' rows of that server), only the rows that take the update."""
    names = list(block.tables)
    if any(name not in masks for name in names):
        raise ParamServerError(
            f"server {server} sent a malformed answer: row state of a table not asked for"
        )
    if servers == 1:  # every table's places in one pass
        found = getattr(masks, "found", None)
        if found is None or len(names) != len(masks) or names != list(masks):
            arrays = [masks[name].numpy() for name in names]
            found = np.concatenate(arrays) if arrays else np.empty(0, np.bool_)
        at, spans = places_of(found, [masks[name].numel() for name in names])
    else:
        places = [_asked_of(masks[name], routes[name])[server] for name in names]
        counts = np.array([p.size for p in places], dtype=np.int64)
        ends = np.cumsum(counts)
        at = np.concatenate(places) if places else np.empty(0, np.int64)
        spans = np.stack([ends - counts, ends], axis=1)
    if not np.array_equal(spans[:, 1] - spans[:, 0], np.array(block.counts, dtype=np.int64)):
        raise ParamServerError(
            f"server {server} sent a malformed answer: row state that is not one entry per "
            "row asked of it"
        )
    parts = {part: plain(value) for part, value in block.parts.items()}
    if block.held is not None and not bool(block.held.all()):  # only the rows that take it
        taking = block.held.numpy()
        kept = np.concatenate([[0], np.cumsum(taking)])
        at, spans = at[taking], kept[spans]
        parts = {part: value[block.held] for part, value in parts.items()}
    return RowStates(names, at, spans, parts)


def _asked_of(mask: Tensor, route: Route) -> list[np.ndarray]:
    """The places among a table's ids of the rows ``mask`` picked that each server holds, in
    the order that server answers."""
    assert route.order is not None
    split = route.order.split_with_sizes(route.counts)
    return [order[part].numpy() for order, part in zip(split, route.split(mask), strict=True)]
