"""What a step looks up, and looking it up fast: a record pass's :class:`Recorder` and what it
finds (:class:`Recorded`: each table's sorted unique ids, and each lookup's positions in them);
and :class:`StepLookups`, which makes a forward's recorded lookups of every table in one autograd
node, and pools ahead the bags of every table whose one bag lookup reads the call's inputs. The
compiled loops (:mod:`paramserver.native`) do the unique ids of all tables in one call and the
node's gather and scatter; without them, torch does the same work, table by table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from paramserver import native
from paramserver.errors import ModelError
from paramserver.trainer.bags import BagNode, Bags, loops_agree_with_torch
from paramserver.trainer.discovery import Derivation, call_tensors, derivation_of
from paramserver.trainer.gradmode import applier, differentiable_once
from paramserver.wire.messages import BagBlock


@dataclass(frozen=True)
class RecordedLookups:
    """One table's lookups in a record pass: the sorted unique ids they touch, and each lookup's
    ids (a flat int64 copy) with their positions in those. A forward making the same lookup on the
    rows pulled for these ids takes its positions from here instead of searching for them."""

    ids: Tensor
    each: list[tuple[Tensor, Tensor]]


class Recorded(NamedTuple):
    """What a record pass found: per row-pulled table its sorted unique ids and its lookups,
    and per server-pooled table its bags."""

    ids: dict[str, Tensor]
    bags: dict[str, BagBlock]
    lookups: dict[str, RecordedLookups]


class RecordingDone(BaseException):  # not Exception: a model's `except Exception` must not eat it
    """Raised inside a record pass once every expected lookup has been recorded."""


class Recorder:
    """The ids (and server-pooled bags) a record pass's lookups make, table by table; raises
    :class:`RecordingDone` once every lookup it expects is in."""

    def __init__(self, expected: dict[str, int] | None):
        self.ids: dict[str, list[Tensor]] = {}
        self.bags: dict[str, BagBlock] = {}
        self.in_order: list[tuple[str, Tensor]] = []  # each lookup's table and ids, as given
        # Each lookup's ids, offsets and options where the trainer pools its bags unweighted
        # (None: any other lookup), for StepLookups.learn_bags.
        self.pooling: dict[str, list[tuple[Tensor, Tensor, BagOptions] | None]] = {}
        # The lookups still expected of each table (None: unknown, the first pass).
        self.missing = None if expected is None else {t: n for t, n in expected.items() if n}

    def add(
        self,
        table: str,
        ids: Tensor,
        bags: BagBlock | None = None,
        pooling: tuple[Tensor, BagOptions] | None = None,
    ) -> None:
        """A lookup of ``ids``; ``bags``: its bags, which the servers pool; ``pooling``: its
        offsets and options, where the trainer pools its bags, unweighted."""
        self.pooling.setdefault(table, []).append(None if pooling is None else (ids, *pooling))
        if bags is not None:
            if table in self.bags:
                raise ModelError(
                    f"table {table} is pooled on the servers, so it may be looked "
                    "up only once per forward"
                )
            self.bags[table] = bags
        self.ids.setdefault(table, []).append(ids.reshape(-1))
        self.in_order.append((table, ids))
        missing = self.missing
        if missing is None:
            return
        if missing.get(table) == 1:
            del missing[table]
        elif table in missing:
            missing[table] -= 1
        if not missing:
            raise RecordingDone


class LookupTable(Protocol):
    """What :class:`StepLookups` reads of a table (a trainer's ``RemoteEmbedding``)."""

    table: str
    embedding_dim: int
    rows: Tensor  # the pulled rows: a leaf that requires grad
    lookups: list[tuple[Tensor, Tensor]]  # the recorded lookups of those rows' ids
    joins_step_lookups: bool  # plain lookups: no bags, padding row or scaling by frequency

    def recorded_lookup(self, flat: Tensor) -> int | None: ...

    def local_padding(self, padding_idx: int | None) -> int | None: ...


class BagOptions(Protocol):
    """What :class:`StepLookups` reads of a bag lookup's options (a ``LookupOptions``)."""

    @property
    def bag_mode(self) -> str | None: ...

    @property
    def padding_idx(self) -> int | None: ...

    @property
    def include_last_offset(self) -> bool: ...

    @property
    def sparse(self) -> bool: ...


@dataclass(frozen=True)
class BagPlan:
    """How a table's one bag lookup a forward reads the call's inputs: its ids and offsets,
    each a view of an input (:class:`~paramserver.trainer.discovery.Derivation`)."""

    ids: Derivation
    offsets: Derivation
    options: BagOptions


class _Pooled(NamedTuple):
    """A lookup :class:`StepLookups` pooled ahead: its output, and what it was made of (the
    ids and offsets it read, their versions then, and its options)."""

    output: Tensor
    ids: Tensor
    offsets: Tensor
    versions: tuple[int, int]
    options: BagOptions

    def made_for(self, ids: Tensor, offsets: Tensor, options: BagOptions) -> bool:
        """Whether a lookup of ``ids`` and ``offsets`` with ``options`` is this one: the same
        views of the same inputs, unchanged since (an in-place change bumps a version)."""
        return (
            _same_view(ids, self.ids)
            and _same_view(offsets, self.offsets)
            and (ids._version, offsets._version) == self.versions
            and (options is self.options or options == self.options)
        )


def _same_view(a: Tensor, b: Tensor) -> bool:
    return a is b or (
        type(a) is Tensor
        and a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class StepLookups:
    """A forward's lookups of the rows pulled for its step, every table's made in one autograd
    node (:class:`_Lookups`): one gather forward and one scatter of the gradients backward,
    where a node per lookup costs an ``index_select`` forward and an ``index_add_`` backward,
    each with its own overhead (a DLRM's 26 tables: about 1.5 ms a step).

    It takes the lookups a record pass saw (:class:`RecordedLookups`) of the tables that join
    (plain lookups of rows the compiled loops take, :func:`paramserver.native.takes_rows`;
    see :class:`LookupTable`), on the first such lookup inside :meth:`forward`; a lookup it
    does not hold is made on its own, as every lookup is without the loops. The node's
    backward is differentiable once: a second-order gradient through a lookup needs the loops
    off (``PARAMSERVER_NATIVE=0``), where ``index_select``'s double backward gives it.
    """

    def __init__(self, tables: Mapping[str, LookupTable]):
        self._tables = tables
        self._active = False
        self._outputs: dict[str, tuple[Tensor, ...]] | None = None
        self._bag_nodes: dict[tuple[int, torch.dtype], BagNode] = {}
        # A forward's tables' rows that the loops pool, by width and type (see bag_node).
        self._bag_groups: dict[tuple[int, torch.dtype], list[Tensor]] | None = None
        self._bag_plans: dict[str, BagPlan] = {}  # see learn_bags
        self._not_ahead: set[str] = set()  # tables a forward looked up otherwise: never again
        self._inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._pooled: dict[str, _Pooled] | None = None

    def begin(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        """The lookups of one forward from now until :meth:`end` (its tables' leaves are those
        of now), called with ``args`` and ``kwargs`` (where its bag lookups are read,
        :meth:`pooled`). (Two calls, not a context manager: a generator's costs a step six
        Python calls.)"""
        self._active, self._outputs = True, None
        self._inputs, self._pooled = (args, kwargs or {}), None

    def end(self, completed: bool) -> None:
        """The forward :meth:`begin` began is over; where it ``completed``, the tables it pooled
        ahead but never looked up are not pooled ahead again."""
        if completed:
            for table in self._pooled or {}:
                self._give_up(table)
        self._active, self._outputs = False, None
        self._inputs, self._pooled = None, None
        for node in self._bag_nodes.values():
            node.close()
        self._bag_nodes, self._bag_groups = {}, None

    def _give_up(self, table: str) -> None:
        """Pool ``table``'s bags ahead no more, whatever later record passes show."""
        del self._bag_plans[table]
        self._not_ahead.add(table)

    def learn_bags(self, args: tuple[Any, ...], kwargs: dict[str, Any], recorder: Recorder) -> None:
        """Learn from a record pass of a call with these arguments which tables' bags a
        forward can pool ahead, all in one node (:meth:`pooled`): a table looked up once, by
        a bag lookup the trainer pools unweighted, whose ids and offsets are views of inputs."""
        inputs = call_tensors(args, kwargs)
        plans: dict[str, BagPlan] = {}
        for table, each in recorder.pooling.items():
            pooling = each[0] if len(each) == 1 else None
            if pooling is None or table in self._not_ahead:
                continue
            ids, offsets, options = pooling
            from_ids = derivation_of(table, ids, inputs)
            from_offsets = derivation_of(table, offsets, inputs)
            if from_ids is not None and from_offsets is not None:
                plans[table] = BagPlan(from_ids, from_offsets, options)
        self._bag_plans = plans

    def pooled(
        self, table: str, ids: Tensor, offsets: Tensor, options: BagOptions
    ) -> Tensor | None:
        """The pooled bags of a bag lookup (unweighted) of ``table``, made ahead with those of
        every other table :meth:`learn_bags` learned, in one node, at the forward's first such
        lookup; None where this lookup is not the one made ahead (the table is then looked up
        on its own from now on)."""
        if not self._active or table not in self._bag_plans:
            return None
        if self._pooled is None:
            self._pooled = self._pool_all()
        made = self._pooled.pop(table, None)
        if made is not None and made.made_for(ids, offsets, options):
            return made.output
        self._give_up(table)
        return None

    def _pool_all(self) -> dict[str, _Pooled]:
        """Every planned table's bag lookup of this forward's inputs, one node per width and
        type of rows: those whose ids are a recorded lookup's, and which the loops take."""
        assert self._inputs is not None
        if not loops_agree_with_torch():
            return {}
        inputs = call_tensors(*self._inputs)
        by_node: dict[BagNode, list[tuple[str, Tensor, Tensor, BagOptions, Bags]]] = {}
        for table, plan in self._bag_plans.items():
            remote, options = self._tables[table], plan.options
            ids, offsets = plan.ids.ids_of(inputs), plan.offsets.ids_of(inputs)
            if ids is None or offsets is None or ids.dim() != 1 or options.bag_mode is None:
                continue
            node = self.bag_node(remote.rows)
            if node is None:
                continue
            recorded = remote.recorded_lookup(native.int64s(ids))
            if recorded is None:
                continue
            bags = Bags.of(
                remote.lookups[recorded][1], offsets, None, options.bag_mode,
                remote.local_padding(options.padding_idx), options.include_last_offset,
                options.sparse,
            )  # fmt: skip
            if bags is not None:
                by_node.setdefault(node, []).append((table, ids, offsets, options, bags))
        made: dict[str, _Pooled] = {}
        for node, lookups in by_node.items():
            numbered = [(node.tables[id(self._tables[t].rows)], bags) for t, *_, bags in lookups]
            outputs = node.pool_all(numbered)
            if outputs is None:  # bags that are not sound: each lookup is made (refused) alone
                continue
            for (table, ids, offsets, options, _), output in zip(lookups, outputs, strict=True):
                versions = (ids._version, offsets._version)
                made[table] = _Pooled(output, ids, offsets, versions, options)
        return made

    def bag_node(self, rows: Tensor) -> BagNode | None:
        """The node this forward's pooled lookups of ``rows`` (a table's leaf) join, with those
        of every table of its width and type (:mod:`paramserver.trainer.bags`); None outside a
        forward, or where the loops do not pool ``rows`` (:func:`paramserver.native.pools_rows`:
        asked once a forward for every table)."""
        if not self._active:
            return None
        groups = self._bag_groups
        if groups is None:
            groups = self._bag_groups = {}
            for remote in self._tables.values():
                if native.pools_rows(remote.rows):
                    key = (remote.rows.shape[1], remote.rows.dtype)
                    groups.setdefault(key, []).append(remote.rows)
        key = (rows.shape[1], rows.dtype)
        node = self._bag_nodes.get(key)
        if node is None:
            group = groups.get(key)
            if group is None:
                return None
            node = self._bag_nodes[key] = BagNode(group)
        return node if id(rows) in node.tables else None

    def output(self, table: str, lookup: int) -> Tensor | None:
        """The rows of ``table``'s recorded lookup ``lookup`` (None: not held here)."""
        if not self._active:
            return None
        if self._outputs is None:
            self._outputs = self._gather()
        outputs = self._outputs.get(table)
        return None if outputs is None else outputs[lookup]

    def _gather(self) -> dict[str, tuple[Tensor, ...]]:
        """Every joining table's recorded lookups, one node per width of rows."""
        by_dim: dict[int, list[LookupTable]] = {}
        for remote in self._tables.values():
            if remote.joins_step_lookups and remote.lookups and native.takes_rows(remote.rows):
                by_dim.setdefault(remote.embedding_dim, []).append(remote)
        gathered: dict[str, tuple[Tensor, ...]] = {}
        for remotes in by_dim.values():
            plan = [(t, positions) for t, r in enumerate(remotes) for _, positions in r.lookups]
            outputs = iter(_apply_lookups(plan, *(r.rows for r in remotes)))
            for remote in remotes:
                gathered[remote.table] = tuple(next(outputs) for _ in remote.lookups)
        return gathered


class _Lookups(torch.autograd.Function):
    """Lookups of rows in several tables' leaves: ``plan`` is ``(table, positions)`` per
    lookup, ``tables`` the leaves; the outputs are each lookup's rows (separate tensors, so a
    model may change them in place). Backward adds each lookup's gradient rows into its
    table's gradient in order (``index_add_``'s), the tables' gradients views of one buffer
    (a push then sends them without joining them again)."""

    @staticmethod
    def forward(ctx: Any, plan: list[tuple[int, Tensor]], *tables: Tensor) -> tuple[Tensor, ...]:
        dim = tables[0].shape[1]
        outputs = tuple(torch.empty(p.numel(), dim, dtype=torch.float32) for _, p in plan)
        native.gather_rows(
            list(tables), [(t, p, o) for (t, p), o in zip(plan, outputs, strict=True)], dim
        )
        ctx.positions, ctx.sizes, ctx.dim = plan, [t.shape[0] for t in tables], dim
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    @differentiable_once
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        positions, sizes, dim = ctx.positions, ctx.sizes, ctx.dim
        touched = sorted({t for (t, _), g in zip(positions, grads, strict=True) if g is not None})
        if not touched:
            return (None,) * (len(sizes) + 1)
        views = native.zeroed_parts([sizes[t] for t in touched], dim, torch.float32)
        parts = dict(zip(touched, views, strict=True))
        order = {t: i for i, t in enumerate(touched)}
        # A gradient travels as it came where its rows are each contiguous (a stack's or a
        # cat's backward hands out strided views): the compiled loop reads them in place.
        native.scatter_rows(
            list(views),
            [
                (order[t], p, _row_major(grad, dim))
                for (t, p), grad in zip(positions, grads, strict=True)
                if grad is not None
            ],
            dim,
        )
        return (None, *(parts.get(t) for t in range(len(sizes))))


_apply_lookups = applier(_Lookups)


def _row_major(grad: Tensor, dim: int) -> Tensor:
    """``grad`` as rows of ``dim`` each contiguous, a view where it is one already."""
    if grad.dim() != 2:
        grad = grad.reshape(-1, dim)
    return grad if grad.stride(1) == 1 or dim == 1 else grad.contiguous()


def unique_lookups(
    recorded: dict[str, list[Tensor]],
) -> tuple[dict[str, Tensor], dict[str, RecordedLookups]]:
    """Each table's sorted unique ids and its :class:`RecordedLookups`, from the ids of each of
    its lookups: one copy of them all (the batch may change later), one search for all."""
    unique: dict[str, Tensor] = {}
    lookups: dict[str, RecordedLookups] = {}
    if not recorded:
        return unique, lookups
    found = native.unique_lookups(list(recorded.values()), _unique_lookups_by_torch)
    for table, (ids, pairs) in zip(recorded, found, strict=True):
        unique[table] = ids
        lookups[table] = RecordedLookups(ids, pairs)
    return unique, lookups


def _unique_lookups_by_torch(
    groups: list[list[Tensor]],
) -> list[tuple[Tensor, list[tuple[Tensor, Tensor]]]]:
    joined = torch.cat([ids.reshape(-1) for each in groups for ids in each]).to(torch.int64)
    sizes = [sum(ids.numel() for ids in each) for each in groups]
    found = []
    for each, looked_up in zip(groups, joined.split_with_sizes(sizes), strict=True):
        ids, positions = torch.unique(looked_up, return_inverse=True)
        parts = [e.numel() for e in each]
        split = looked_up.split_with_sizes(parts), positions.split_with_sizes(parts)
        found.append((ids, list(zip(*split, strict=True))))
    return found
