"""A member of a three-process RPC world that loses its server and rejoins a new one, for
tests/test_rejoin.py: ``python tests/_rejoin_member.py ROLE DIR GENERATION``.

``server`` (rank 0) answers ``echo`` with its argument and its pid, and leaves once every
caller has left. ``caller`` (ranks 1 and 2) calls it until the call fails (the test kills the
server), then rejoins at generation 1 (where the test starts a new server) and calls again;
it prints each answer, and what it kept across the rejoin.
"""

from __future__ import annotations

import os
import sys
import time

from torch.futures import Future

from paramserver.errors import ServerLostError
from paramserver.futures import completed
from paramserver.transport import rpc

WORLD = 3


class Echo:
    def handle(self, op: object, args: object) -> Future:
        assert op == "echo" and isinstance(args, tuple)
        return completed((args[0], os.getpid()))


def join(name: str, rank: int, directory: str, generation: int) -> None:
    rpc.start(
        name, rank, WORLD, init_method=f"file://{directory}/rendezvous-{generation}",
        num_threads=4, timeout_s=10.0, loopback_only=True, generation=generation,
    )  # fmt: skip


def main() -> None:
    role, directory, generation = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        rpc.expose(Echo())
        join(rpc.server_name(0), 0, directory, generation)
        print("serving", flush=True)
        rpc.stop(graceful=True)  # once every caller has left
        return
    rank = int(role.removeprefix("caller"))
    join(rpc.trainer_name(rank - 1), rank, directory, generation)
    transport = rpc.RpcTransport(1, timeout_s=10.0)
    kept = {"calls": 0}  # state of this process, which the rejoin must not lose
    try:
        while True:
            answer, pid = transport.call(0, "echo", kept["calls"]).wait()
            kept["calls"] += 1
            print(f"answered {answer} by {pid}", flush=True)
            time.sleep(0.05)
    except ServerLostError as lost:
        print(f"lost: {lost}", flush=True)
    rpc.leave_lost_world()
    join(rpc.trainer_name(rank - 1), rank, directory, generation + 1)
    answer, pid = transport.call(0, "echo", kept["calls"]).wait()
    print(f"after rejoin answered {answer} by {pid}, kept {kept['calls']}", flush=True)
    rpc.stop(graceful=True)


if __name__ == "__main__":
    main()
