"""How stale the gradients a server applies are: the updates it applied between the read a
gradient was computed from and the gradient's arrival (the summary's ``staleness``, a
histogram; always 0 in sync mode). Not thread-safe: the coordinator's lock guards it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class GradientAges:
    """The updates applied so far, each training read's count then, and the histogram of the
    ages of the gradients that came back."""

    def __init__(self) -> None:
        self.updates = 0  # updates applied (pushes, or rounds in sync mode)
        self._read_at: dict[tuple[int, int], int] = {}  # (trainer, call) -> updates then
        self.histogram: Counter[int] = Counter()

    def read(self, trainer: int, call: int) -> None:
        """``trainer``'s call ``call`` read values: its gradients will come back."""
        self._read_at[(trainer, call)] = self.updates

    def arrived(self, trainer: int, grads_call: int) -> None:
        """The gradients computed from ``trainer``'s call ``grads_call`` arrived: count their
        age (once; a read not recorded counts nothing)."""
        read_at = self._read_at.pop((trainer, grads_call), None)
        if read_at is not None:
            self.histogram[self.updates - read_at] += 1

    def dropped(self, trainer: int, grads_call: int) -> None:
        """Those gradients will never be applied (their round closed without them)."""
        self._read_at.pop((trainer, grads_call), None)

    def forget_before(self, trainer: int, grads_call: int) -> None:
        """``trainer``'s later gradients come from reads at ``grads_call`` or after."""
        stale = [k for k in self._read_at if k[0] == trainer and k[1] < grads_call]
        for read in stale:
            del self._read_at[read]

    def forget_trainers(self, gone: Iterable[int]) -> None:
        """Trainers that left: their reads will never come back."""
        gone = set(gone)
        self._read_at = {k: v for k, v in self._read_at.items() if k[0] not in gone}

    def totals(self) -> dict[str, int]:
        """The gradients counted so far and their summed staleness."""
        return {
            "gradients": sum(self.histogram.values()),
            "staleness_sum": sum(age * n for age, n in self.histogram.items()),
        }
