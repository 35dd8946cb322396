"""paramserver: a sharded parameter server for PyTorch on torch.distributed.rpc.

Servers hold the parameters (dense tensors placed whole, embedding tables split by row) and
apply updates with torch.optim's math; trainers pull the rows their batch touches, run forward
and backward, and push gradients back, one fused round trip per server per step.
"""

from paramserver import metrics
from paramserver.api import TrainResult, train
from paramserver.config import OptimizerConfig, TableCodecs, TrainConfig
from paramserver.embedding import DynamicEmbedding
from paramserver.errors import (
    CheckpointError,
    ConfigError,
    InvalidBatchError,
    InvalidPushError,
    JobFailedError,
    ModelError,
    ParamServerError,
    ServerLostError,
    TrainerDepartedError,
)
from paramserver.metrics import Evaluation

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DynamicEmbedding",
    "Evaluation",
    "InvalidBatchError",
    "InvalidPushError",
    "JobFailedError",
    "ModelError",
    "OptimizerConfig",
    "ParamServerError",
    "ServerLostError",
    "TableCodecs",
    "TrainConfig",
    "TrainResult",
    "TrainerDepartedError",
    "metrics",
    "train",
]
