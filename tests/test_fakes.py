"""The fault-injecting transport does exactly what its rules say, at exactly the calls they
match: fault tests rely on it instead of on timing."""

from __future__ import annotations

from typing import Any

import pytest
from torch.futures import Future

from paramserver.errors import ServerLostError
from paramserver.transport.local import LocalTransport
from tests.fakes import FaultyTransport


class Recorder:
    """A server's side that records what it handles; ``slow`` ops are answered by the test."""

    def __init__(self, slow: tuple[str, ...] = ()) -> None:
        self.handled: list[str] = []
        self.slow = slow
        self.waiting: list[Future] = []

    def handle(self, op: object, args: object) -> Future:
        self.handled.append(str(op))
        answer: Future = Future()
        if op in self.slow:
            self.waiting.append(answer)
        else:
            answer.set_result(f"{op} done")
        return answer


def faulty(num_servers: int = 2, slow: tuple[str, ...] = ()) -> tuple[FaultyTransport, list[Any]]:
    servers = [Recorder(slow) for _ in range(num_servers)]
    return FaultyTransport(LocalTransport(servers)), servers


def op_is(name: str) -> Any:
    return lambda server, op, args: op == name


def test_without_rules_calls_pass_through_and_are_recorded() -> None:
    transport, servers = faulty()
    assert transport.call(1, "pull").wait() == "pull done"
    assert servers[1].handled == ["pull"] and transport.calls == [(1, "pull")]


def test_fail_fails_only_the_matching_calls_and_they_never_arrive() -> None:
    transport, servers = faulty()
    transport.fail(lambda server, op, args: op == "push" and args == (3,))
    with pytest.raises(ServerLostError, match="server 0 was lost: push") as caught:
        transport.call(0, "push", 3).wait()
    assert caught.value.server == 0
    assert transport.call(0, "push", 4).wait() == "push done"
    assert servers[0].handled == ["push"]  # only the second
    transport.fail(op_is("pull"), error=lambda server, op: RuntimeError(f"{op} refused"))
    with pytest.raises(RuntimeError, match="pull refused"):
        transport.call(1, "pull").wait()


def test_a_crash_fails_the_call_its_pending_answers_and_every_later_call() -> None:
    transport, servers = faulty(slow=("wait",))
    pending = transport.call(1, "wait")  # reached server 1, not answered yet
    other = transport.call(0, "wait")
    transport.crash_at(1, op_is("checkpoint"))
    crash = transport.call(1, "checkpoint")
    for future in (pending, crash, transport.call(1, "pull")):
        with pytest.raises(ServerLostError, match="server 1 was lost"):
            future.wait()
    assert servers[1].handled == ["wait"]  # nothing after the crash reached it
    servers[1].waiting[0].set_result("too late")  # a late answer changes nothing
    assert transport.crashed == {1}
    # Server 0 is untouched: its pending call is answered, new calls go through.
    servers[0].waiting[0].set_result("answered")
    assert other.wait() == "answered"
    assert transport.call(0, "pull").wait() == "pull done"


def test_a_crash_triggered_by_a_call_to_another_server_lets_that_call_through() -> None:
    transport, servers = faulty()
    transport.crash_at(1, lambda server, op, args: server == 0 and op == "push")
    assert transport.call(0, "push").wait() == "push done"
    with pytest.raises(ServerLostError):
        transport.call(1, "push").wait()
    assert servers[1].handled == []


def test_hold_and_freeze_leave_calls_unanswered_where_they_say() -> None:
    transport, servers = faulty()
    transport.hold(op_is("part"))
    transport.freeze_after(0, op_is("last"))
    held = transport.call(1, "part")
    assert servers[1].handled == ["part"] and not held.done()  # done, but never answered
    assert transport.call(0, "last").wait() == "last done"  # the freezing call is answered
    later = transport.call(0, "pull")
    assert not later.done() and servers[0].handled == ["last"]
    assert transport.call(1, "pull").wait() == "pull done"
