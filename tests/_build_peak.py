"""How much memory building one process's part of a model takes: run as
``python -m tests._build_peak {server,trainer} ROWS SERVERS``; prints the growth of the peak
resident size, in MiB, over the build of server 1's shard or of a trainer's model, for a model
with one ``nn.Embedding(ROWS, 64)`` table (float32: ROWS x 256 bytes) and a small dense part."""

from __future__ import annotations

import functools
import json
import sys

import torch
from torch import nn

import paramserver as ps
from paramserver.launch.roles import build_server
from paramserver.trainer.loop import trainer_model
from tests.procs import reset_peak, vm_kib

DIM = 64


class OneTable(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.table = nn.Embedding(rows, DIM)
        nn.init.normal_(self.table.weight, std=0.01)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).squeeze(-1)


def main() -> None:
    role, rows, servers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model_fn = functools.partial(OneTable, rows)
    torch.set_num_threads(1)
    trainer_model(functools.partial(OneTable, 10), 0)  # first use's one-off costs, not counted
    reset_peak()
    start_kib = vm_kib("VmRSS")
    if role == "server":
        config = ps.TrainConfig(servers=servers, trainers=1, optimizer="sgd")
        endpoint = build_server(1 % servers, config, model_fn)
        rows_held = endpoint.shard.store.tables["table.weight"].nbytes() // (DIM * 4)
        endpoint.coordinator.close()
    else:
        rows_held = 0
        trainer_model(model_fn, 0)
    growth_mib = (vm_kib("VmHWM") - start_kib) / 1024
    print(json.dumps({"growth_mib": growth_mib, "rows_held": rows_held}))


if __name__ == "__main__":
    main()
