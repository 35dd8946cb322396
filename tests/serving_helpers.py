"""What the serving tests share: a small model with a fixed and a dynamic table, its example
inputs, and a raw HTTP request."""

from __future__ import annotations

import http.client

import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver.serving.frontend import Frontend
from paramserver.serving.model import ServedModel


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(50, 4)
        self.user = ps.DynamicEmbedding(4, default_value=0.5)
        self.out = nn.Linear(8, 1)

    def forward(self, items: Tensor, users: Tensor) -> Tensor:
        return self.out(torch.cat([self.item(items), self.user(users)], dim=1))


EXAMPLE = [torch.tensor([1, 2]), torch.tensor([10, 11])]
INFER = "/v2/models/item.weight/infer"  # a lookup of Ranker's fixed table


def ready_frontend() -> Frontend:
    """Ranker's front end from its initial model, ready to answer."""
    made = Frontend(ServedModel(Ranker, 0), example=EXAMPLE)
    made.ready = True
    return made


def raw_http(port: int, method: str, path: str, body: bytes, headers: dict | None = None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request(method, path, body, headers or {})
    answer = connection.getresponse()
    return answer.status, answer.read()
