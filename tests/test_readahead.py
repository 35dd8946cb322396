"""ReadAhead: items in order from a background thread, a bounded number ahead; the producer's
error raised in the consumer; no thread left behind however the consumer stops."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from paramserver.data.readahead import ReadAhead


class Source:
    """A producer that records how far it got and whether it was closed."""

    def __init__(self, count: int, fail_at: int | None = None):
        self.count, self.fail_at = count, fail_at
        self.made = 0
        self.closed = threading.Event()

    def items(self) -> Iterator[int]:
        try:
            for i in range(self.count):
                if i == self.fail_at:
                    raise ValueError(f"bad item {i} (file.tsv, line {i + 1})")
                self.made += 1
                yield i
        finally:
            self.closed.set()


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def wait_until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_items_come_in_order_and_the_thread_ends_with_them() -> None:
    source = Source(100)
    ahead = ReadAhead(source.items, depth=3, name="ra-order")
    assert list(ahead) == list(range(100))
    assert not ahead.running and not threads_named("ra-order")
    assert source.closed.is_set()
    assert next(ahead, None) is None  # stays exhausted


def test_the_producer_runs_at_most_depth_items_ahead() -> None:
    source = Source(1000)
    ahead = ReadAhead(source.items, depth=4, name="ra-bounded")
    assert next(ahead) == 0
    # One taken, four queued, one made and waiting to be queued: six at most, ever.
    wait_until(lambda: source.made >= 6)
    time.sleep(0.2)
    assert source.made == 6
    ahead.close()


def test_an_error_is_raised_in_the_consumer_after_the_items_before_it() -> None:
    source = Source(10, fail_at=7)
    ahead = ReadAhead(source.items, depth=2, name="ra-error")
    taken = []
    with pytest.raises(ValueError, match=r"bad item 7 \(file.tsv, line 8\)") as raised:
        for item in ahead:
            taken.append(item)
    assert taken == list(range(7))
    # The producer's own frame is in the traceback: where it failed, not only where it surfaced.
    frames = []
    tb = raised.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "items" in frames
    wait_until(lambda: not threads_named("ra-error"))
    assert next(ahead, None) is None


def test_close_stops_a_producer_blocked_on_a_full_queue() -> None:
    source = Source(10**9)
    ahead = ReadAhead(source.items, depth=2, name="ra-close")
    assert next(ahead) == 0
    wait_until(lambda: source.made >= 3)  # the queue is full: the producer waits
    ahead.close()
    assert not ahead.running and not threads_named("ra-close")
    assert source.closed.is_set()  # the producer's finally ran (files closed)
    assert next(ahead, None) is None


def test_a_dropped_iterator_stops_its_thread() -> None:
    source = Source(10**9)
    ahead = ReadAhead(source.items, depth=2, name="ra-dropped")
    for item in ahead:
        if item == 5:
            break  # a consumer that stops early and never calls close()
    assert threads_named("ra-dropped")
    del ahead
    gc.collect()
    assert not threads_named("ra-dropped")
    assert source.closed.is_set()


def test_a_consumer_that_never_starts_still_ends_the_thread() -> None:
    source = Source(10**9)
    ReadAhead(source.items, depth=1, name="ra-unused")  # dropped at once
    gc.collect()
    assert not threads_named("ra-unused")
    assert source.closed.wait(5)


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth"):
        ReadAhead(Source(1).items, depth=0, name="ra-depth")


class Closable(Iterator[int]):
    """An iterator (not a generator: nothing closes it when it is dropped) with a close()."""

    def __init__(self) -> None:
        self.next_item = 0
        self.closed = False

    def __next__(self) -> int:
        self.next_item += 1
        return self.next_item - 1

    def close(self) -> None:
        self.closed = True


def test_the_producer_is_closed_when_the_consumer_stops() -> None:
    source = Closable()
    ahead = ReadAhead(lambda: source, depth=2, name="ra-closable")
    assert next(ahead) == 0
    ahead.close()
    assert source.closed
