"""Pooling on the server: the bags each trainer pulled pooled sums of, kept until the gradient
of those sums comes back and is turned into row gradients. Not thread-safe: the coordinator's
lock guards it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from paramserver.wire.messages import BagBlock


class PooledPulls:
    """(trainer, pull call, table) -> the bags that call pooled; each used by one push."""

    def __init__(self) -> None:
        self.bags: dict[tuple[int, int, str], BagBlock] = {}

    def pulled(self, trainer: int, call: int, pool_rows: Mapping[str, BagBlock]) -> None:
        for name, block in pool_rows.items():
            self.bags[(trainer, call, name)] = block

    def of(self, trainer: int, pull_call: int, table: str) -> BagBlock | None:
        return self.bags.get((trainer, pull_call, table))

    def all_held(self, trainer: int, pooled_from: Mapping[str, int]) -> bool:
        """Whether every pull ``pooled_from`` names (table -> pull call) is held, unused."""
        return all((trainer, call, name) in self.bags for name, call in pooled_from.items())

    def use(self, trainer: int, pooled_from: Mapping[str, int]) -> None:
        """Those pulls' gradients arrived: each pooled pull is used once."""
        for name, call in pooled_from.items():
            del self.bags[(trainer, call, name)]

    def forget_trainers(self, gone: Iterable[int]) -> None:
        gone = set(gone)
        self.bags = {k: v for k, v in self.bags.items() if k[0] not in gone}
