"""The calls a trainer keeps for servers that may be restarted (``--recover``).

Each answer says which of this trainer's calls the server's change log holds
(``PushPullReply.durable_through``); the later ones are kept here, as they were sent (error
feedback and the like must not run twice), to be sent again, in order, to a server restarted
from its log (see :meth:`paramserver.trainer.client.PSClient.send_again`). A server that keeps
no such log says None, and nothing is kept for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from paramserver.config import CALLS_PER_MESSAGE
from paramserver.wire.messages import PushPullRequest


class KeptCalls:
    def __init__(self, num_servers: int):
        self._by_server: list[deque[PushPullRequest]] = [deque() for _ in range(num_servers)]
        self.resent = 0  # calls sent again after a server was restarted

    def sent(self, messages: Iterable[list[PushPullRequest]]) -> None:
        """Each server's message (its calls, in order), as just sent."""
        for kept, message in zip(self._by_server, messages, strict=True):
            kept.extend(message)

    def release(self, server: int, durable_through: int | None) -> None:
        """Let go of the calls ``server``'s log holds now (all where it keeps none)."""
        kept = self._by_server[server]
        if durable_through is None:
            kept.clear()
            return
        while kept and kept[0].call <= durable_through:
            kept.popleft()

    def to_send_again(self, server: int) -> list[list[PushPullRequest]]:
        """``server``'s kept calls in order, as messages of at most CALLS_PER_MESSAGE; never
        empty while a call to it is awaited (kept until answered)."""
        calls = list(self._by_server[server])
        self.resent += len(calls)
        return [
            calls[at : at + CALLS_PER_MESSAGE] for at in range(0, len(calls), CALLS_PER_MESSAGE)
        ]

    def calls(self, server: int) -> list[int]:
        """The numbers of the calls kept for ``server``."""
        return [request.call for request in self._by_server[server]]
