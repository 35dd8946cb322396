"""A server under hostile calls, alone in this process so that its peak memory can be read.

Run by tests/test_message_caps.py as ``python -m tests._hostile_server``: builds one server
(one table of 1,000 fixed rows, one dynamic table, both 64 wide, the default 1 GiB
``--max-message-mb``), hands it each hostile call of :func:`hostile_calls` as a transport would
(``ServerEndpoint.handle``, the message already received), and prints one JSON line per call:
how far the process's peak resident memory rose during it, the error it got, and whether the
server's state changed. Every call would read or decode one 64-wide float32 row per id of
``HOSTILE_IDS`` ids: 2 GB, about twice the cap.
"""

from __future__ import annotations

import json
import resource
from collections.abc import Iterator

import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver.embedding import DynamicEmbedding
from paramserver.launch.roles import build_server
from paramserver.server.endpoint import ServerEndpoint
from paramserver.wire.compression import Encoded
from paramserver.wire.idcodec import compact_ids
from paramserver.wire.messages import BagBlock, PushPullRequest, RowBlock
from tests.procs import reset_peak, vm_kib

DIM = 64
HOSTILE_IDS = 8_000_000  # x DIM x 4 bytes = 2.05 GB; the ids themselves are 64 MB
# Should a call allocate far more than the test expects, it fails here instead of taking the
# machine's memory: an address-space limit this much above the process's size at start.
ADDRESS_SPACE_MARGIN = 6 << 30


class HostileTarget(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fixed = nn.Embedding(1000, DIM)
        self.hashed = DynamicEmbedding(DIM)
        self.head = nn.Linear(DIM, 1)


def hostile_calls() -> Iterator[tuple[str, str, PushPullRequest]]:
    """(case, operation, request) for each hostile call."""
    many = torch.arange(HOSTILE_IDS)  # sorted and unique
    # A top-k encoding of row gradients (no trainer sends one) for ids past the table's end:
    # one kept entry, standing for HOSTILE_IDS x DIM values.
    one_entry = (torch.zeros(1, dtype=torch.int32), torch.ones(1))
    topk = Encoded("topk", (HOSTILE_IDS, DIM), one_entry)
    yield (
        "top-k row gradient of 8M ids",
        "push_pull",
        PushPullRequest(0, 0, row_grads={"fixed.weight": RowBlock(many, topk)}),
    )
    yield (
        "pull of 8M ids",
        "pull",
        PushPullRequest(0, 0, pull_dense=False, pull_rows={"hashed.weight": many}),
    )
    yield (  # 8 MB on the wire: one uint8 step per id
        "pull of 8M packed ids",
        "pull",
        PushPullRequest(0, 0, pull_dense=False, pull_rows={"hashed.weight": compact_ids(many)}),
    )
    zeros = torch.zeros(HOSTILE_IDS, dtype=torch.int64)  # row 0, 8M times, in bag 0
    yield (
        "push_pull pooling one row 8M times",
        "push_pull",
        PushPullRequest(0, 0, pool_rows={"fixed.weight": BagBlock(zeros, zeros.clone(), 1)}),
    )


def state_of(endpoint: ServerEndpoint) -> tuple[dict[str, dict[str, Tensor]], str]:
    coordinator = endpoint.coordinator
    with coordinator.lock:
        calls = repr(
            (coordinator.last_call, sorted(coordinator.pooled.bags), coordinator.ages.updates)
        )
    return endpoint.shard.store.export_state(with_optimizer=True), calls


def same_state(a: tuple[dict[str, dict[str, Tensor]], str], b: tuple[dict, str]) -> bool:
    (tensors_a, calls_a), (tensors_b, calls_b) = a, b
    return (
        calls_a == calls_b
        and tensors_a.keys() == tensors_b.keys()
        and all(
            entry.keys() == tensors_b[name].keys()
            and all(torch.equal(t, tensors_b[name][key]) for key, t in entry.items())
            for name, entry in tensors_a.items()
        )
    )


def main() -> None:
    torch.set_num_threads(1)
    limit = vm_kib("VmSize") * 1024 + ADDRESS_SPACE_MARGIN
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    config = ps.TrainConfig(servers=1, trainers=1, optimizer="adagrad")
    endpoint = build_server(0, config, HostileTarget)
    try:
        for case, op, request in hostile_calls():
            before = state_of(endpoint)
            reset_peak()
            start_kib = vm_kib("VmRSS")
            answer = endpoint.handle(op, (request,))
            error = None
            try:
                answer.wait()
            except Exception as failure:
                error = {"type": type(failure).__name__, "message": str(failure)[:300]}
            del answer, request
            growth_mib = (vm_kib("VmHWM") - start_kib) / 1024
            unchanged = same_state(before, state_of(endpoint))
            result = {"case": case, "peak_growth_mib": growth_mib, "error": error}
            print(json.dumps({**result, "state_unchanged": unchanged}), flush=True)
    finally:
        endpoint.coordinator.close()


if __name__ == "__main__":
    main()
