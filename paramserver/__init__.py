"""paramserver: a sharded parameter server for PyTorch on torch.distributed.rpc.

Servers hold the parameters (dense tensors placed whole, embedding tables split by row) and
apply updates with torch.optim's math; trainers pull the rows their batch touches, run forward
and backward, and push gradients back, one fused round trip per server per step.
"""

from typing import Any

from paramserver import metrics
from paramserver.api import TrainResult, run, train
from paramserver.config import TableCodecs, TrainConfig
from paramserver.embedding import DynamicEmbedding
from paramserver.errors import (
    ChangeLogError,
    CheckpointError,
    ConfigError,
    InvalidBatchError,
    InvalidPushError,
    JobFailedError,
    LoopError,
    ModelError,
    ParamServerError,
    ServerLostError,
    StoreError,
    StreamError,
    TrainerDepartedError,
    TrainerGroupError,
)
from paramserver.metrics import Evaluation
from paramserver.modelplan import initial_model
from paramserver.optimconfig import OptimizerConfig

__all__ = [
    "ChangeLogError",
    "CheckpointError",
    "ConfigError",
    "DynamicEmbedding",
    "Evaluation",
    "InvalidBatchError",
    "InvalidPushError",
    "JobFailedError",
    "LoopError",
    "ModelError",
    "OptimizerConfig",
    "ParamServerError",
    "ServerLostError",
    "StoreError",
    "StreamError",
    "TableCodecs",
    "TrainConfig",
    "TrainContext",
    "TrainResult",
    "TrainerDepartedError",
    "TrainerGroupError",
    "initial_model",
    "metrics",
    "run",
    "serve",
    "train",
]


def __getattr__(name: str) -> Any:
    # TrainContext is the trainer's: loaded when asked for, so `import paramserver` stays light.
    if name == "TrainContext":
        from paramserver.trainer.context import TrainContext

        return TrainContext
    if name == "serve":  # serving's modules too: loaded when asked for
        from paramserver.serving.run import serve

        return serve
    raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
