"""FBGEMM and TorchRec as a user of them would build the bench suite's DLRM on CPU: the entries
``fbgemm_fused`` (one process, the tables as one table-batched FBGEMM module with the update
fused into the backward pass) and ``torchrec_dmp`` (TorchRec's ``DistributedModelParallel`` on
gloo ranks) of ``bench_torchrec.py``, which says what each measures; each runs in processes of
its own. Neither package is a dependency of the project: they are imported inside the entries."""

from __future__ import annotations

import os
import resource
import time
import warnings
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from systems import LOSS, free_port, peak_rss_mb, run_isolated
from torch import Tensor, nn
from workloads import ClickWorkload

import paramserver as ps
from paramserver.metrics import binary_metrics, evaluate_binary
from paramserver.modelplan import build_model
from paramserver.models.dlrm import DLRM
from paramserver.tableinit import RowInit

EPS = 1e-10  # torch.optim.Adagrad's, which paramserver's adagrad resolves to as well
OPTIMIZERS = ("adagrad", "sgd")


def torch_optimizer(name: str, lr: float) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """torch.optim's class for ``--optimizer`` ``name`` and its settings (Adagrad at
    :data:`EPS`, SGD without momentum), as the dense layers and TorchRec's tables take them."""
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": lr, "eps": EPS}
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr}
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")


def dense_optimizer(name: str, parameters: Iterable[Tensor], lr: float) -> torch.optim.Optimizer:
    """The dense layers' torch.optim optimizer for ``--optimizer`` ``name``."""
    optimizer_class, settings = torch_optimizer(name, lr)
    return optimizer_class(parameters, **settings)


class DenseParts(nn.Module):
    """The DLRM's dense layers and interaction (as :class:`paramserver.models.dlrm.DLRM`), taken
    from the suite's seeded model, for the entries whose tables live elsewhere."""

    def __init__(self, workload: ClickWorkload, seed: int):
        super().__init__()
        built = build_model(workload.model, seed)  # tables on the meta device, dense layers real
        if not isinstance(built.model, DLRM):
            raise TypeError(f"the dlrm workload built a {type(built.model).__name__}")
        self.bottom = built.model.bottom
        self.top = built.model.top
        self.pairs = built.model.pairs
        self.inits: list[RowInit] = [
            built.inits[f"embeddings.{t}.weight"] for t in range(workload.num_tables)
        ]

    def dense_parameters(self) -> list[nn.Parameter]:
        return [*self.bottom.parameters(), *self.top.parameters()]

    def interact(self, bottom: Tensor, pooled: Tensor) -> Tensor:
        """Logits from the bottom MLP's output ``[B, D]`` and the tables' ``[B, T, D]``."""
        stacked = torch.cat([bottom.unsqueeze(1), pooled], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)


def feature_major(sparse: Tensor) -> Tensor:
    """``[B, T]`` ids as the 1-D list both TBE and a KeyedJaggedTensor take: table 0's ids of
    every sample, then table 1's, and so on."""
    return sparse.t().reshape(-1)


class FusedDLRM(DenseParts):
    """The DLRM with its tables as one FBGEMM CPU table-batched embedding, its update
    (``EXACT_ADAGRAD`` or ``EXACT_SGD``) fused into the backward pass."""

    def __init__(self, workload: ClickWorkload, seed: int, optimizer: str, lr: float):
        super().__init__(workload, seed)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        fused = {"adagrad": EmbOptimType.EXACT_ADAGRAD, "sgd": EmbOptimType.EXACT_SGD}
        spec = (workload.rows, workload.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
        self.tables = SplitTableBatchedEmbeddingBagsCodegen(
            [spec] * workload.num_tables,
            optimizer=fused[optimizer],
            learning_rate=lr,
            eps=EPS,  # read by EXACT_ADAGRAD only
            pooling_mode=PoolingMode.SUM,
        )
        with torch.no_grad():
            for weight, init in zip(self.tables.split_embedding_weights(), self.inits, strict=True):
                init.fill(weight, torch.arange(workload.rows))
        self._offsets: dict[int, Tensor] = {}

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        batch, num_tables = sparse.shape
        bags = batch * num_tables
        if bags not in self._offsets:  # one id per bag: offsets 0, 1, ..., bags
            self._offsets[bags] = torch.arange(bags + 1)
        pooled = self.tables(feature_major(sparse), self._offsets[bags])  # [B, T * D]
        return self.interact(self.bottom(dense), pooled.view(batch, num_tables, -1))


class RecDLRM(DenseParts):
    """The DLRM with its tables as a TorchRec EmbeddingBagCollection (on the meta device until
    DistributedModelParallel shards it)."""

    def __init__(self, workload: ClickWorkload, seed: int):
        super().__init__(workload, seed)
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        self.features = [f"f{t}" for t in range(workload.num_tables)]
        configs = [
            EmbeddingBagConfig(
                name=f"t{t}",
                embedding_dim=workload.embedding_dim,
                num_embeddings=workload.rows,
                feature_names=[feature],
            )
            for t, feature in enumerate(self.features)
        ]
        self.sparse = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        from torchrec import KeyedJaggedTensor

        batch, num_tables = sparse.shape
        ids = KeyedJaggedTensor(
            keys=self.features,
            values=feature_major(sparse),
            lengths=torch.ones(batch * num_tables, dtype=torch.int64),
        )
        pooled = self.sparse(ids)  # a KeyedTensor, one D-wide block per feature
        if pooled.keys() != self.features:
            raise RuntimeError(f"pooled features in the order {pooled.keys()}")
        return self.interact(self.bottom(dense), pooled.values().view(batch, num_tables, -1))


# -- the entries, each in processes of its own --------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have exited."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def train_loop(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], batches: Iterable[Any]
) -> dict[str, Any]:
    """One update per batch (the tables' own happen in the backward pass)."""
    samples = steps = 0
    cpu_started, started = cpu_seconds(), time.perf_counter()
    for (dense, sparse), target in batches:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        LOSS(model(dense, sparse), target).backward()
        for optimizer in optimizers:
            optimizer.step()
        samples += int(target.shape[0])
        steps += 1
    return {
        "samples": samples,
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "train_cpu_s": cpu_seconds() - cpu_started,
    }


def fbgemm_fused(workload: ClickWorkload, config: ps.TrainConfig) -> dict[str, Any]:
    torch.set_num_threads(config.threads_per_process)
    import fbgemm_gpu  # noqa: F401  (its operators; the import is not the entry's work)

    cpu_started = cpu_seconds()
    model = FusedDLRM(workload, config.seed, config.optimizer, workload.lr)
    dense = dense_optimizer(config.optimizer, model.dense_parameters(), workload.lr)
    result = train_loop(model, [dense], islice(workload.train_stream(0, 1), config.steps))
    result["peak_rss_mb_per_trainer"] = [peak_rss_mb()]
    result["metrics"] = evaluate_binary(model, workload.held_out())
    result["cpu_s"] = cpu_seconds() - cpu_started
    return result


def torchrec_rank(
    rank: int, world_size: int, port: int, workload: ClickWorkload, config: ps.TrainConfig
) -> dict[str, Any]:
    """One DMP rank: ``config.steps // world_size`` steps on its share of the stream; rank 0
    reports the held-out metrics."""
    torch.set_num_threads(config.threads_per_process)
    import torchrec  # noqa: F401  (the import is not the entry's work)

    cpu_started = cpu_seconds()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        dmp, dense = sharded_model(workload, config.seed, config.optimizer, world_size)
        assert config.steps is not None  # run_entry sets it
        batches = islice(workload.train_stream(rank, world_size), config.steps // world_size)
        dist.barrier()
        result = train_loop(dmp, [dense], batches)
        result["peak_rss_mb"] = peak_rss_mb()
        metrics = evaluate_sharded(dmp, workload, rank, world_size)
        dist.barrier()  # leave together: a rank that exits early can abort its peer's gloo
    finally:
        dist.destroy_process_group()
    if metrics is not None:
        result["metrics"] = metrics
    result["cpu_s"] = cpu_seconds() - cpu_started
    return result


def evaluate_sharded(
    dmp: nn.Module, workload: ClickWorkload, rank: int, world_size: int
) -> dict[str, float] | None:
    """Held-out metrics of the sharded model, on rank 0 (None elsewhere). The lookups are
    collective, so every rank runs each held-out batch, on its slice of the samples (rank ``r``
    takes samples ``r, r + world_size, ...``), and rank 0 gathers the logits."""
    logits, targets = [], []
    dmp.eval()
    with torch.no_grad():
        for (dense, sparse), target in workload.held_out():
            mine = slice(rank, None, world_size)
            logits.append(dmp(dense[mine], sparse[mine]))
            targets.append(target[mine])
    dmp.train()
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object((torch.cat(logits), torch.cat(targets)), gathered, dst=0)
    if gathered is None:
        return None
    return binary_metrics(torch.cat([o for o, _ in gathered]), torch.cat([t for _, t in gathered]))


def sharded_model(
    workload: ClickWorkload, seed: int, optimizer: str, world_size: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """This rank's DistributedModelParallel of :class:`RecDLRM` (tables table-wise, ``optimizer``
    fused; the process group up) and the dense parameters' optimizer."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = RecDLRM(workload, seed)
    table_optimizer, settings = torch_optimizer(optimizer, workload.lr)
    apply_optimizer_in_backward(table_optimizer, model.sparse.parameters(), settings)
    # Tables in contiguous blocks (0-3 on rank 0, 4-7 on rank 1): the sharded collection
    # returns its pooled features grouped by rank, so then in the model's order.
    tables = workload.num_tables
    where = {f"t{t}": table_wise(rank=t * world_size // tables) for t in range(tables)}
    module_plan = construct_module_sharding_plan(
        model.sparse, where, local_size=world_size, world_size=world_size, device_type="cpu"
    )
    with warnings.catch_warnings():  # torchrec's own use of a deprecated DDP argument
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*is deprecated")
        dmp = DistributedModelParallel(
            model,
            device=torch.device("cpu"),
            plan=ShardingPlan({"sparse": module_plan}),
            sharders=[EmbeddingBagCollectionSharder()],
        )
    load_initial_tables(dmp, model.inits)
    dense_parameters = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, dense_optimizer(optimizer, dense_parameters, workload.lr)


def load_initial_tables(dmp: nn.Module, inits: list[RowInit]) -> None:
    """This rank's shards of every table, set to the suite's initial rows (the state dict's
    shards are views of the TBE weights the lookups read)."""
    state = dmp.state_dict()
    with torch.no_grad():
        for t, init in enumerate(inits):
            for shard in state[f"sparse.embedding_bags.t{t}.weight"].local_shards():
                (row, column), (rows, columns) = (
                    shard.metadata.shard_offsets,
                    shard.metadata.shard_sizes,
                )
                if (column, columns) != (0, init.shape[1]):
                    raise RuntimeError(f"table t{t}: a column shard; only table-wise is set up")
                init.fill(shard.tensor, torch.arange(row, row + rows))


def run_torchrec(
    workload: ClickWorkload, config: ps.TrainConfig, ranks: int, timeout_s: float, start: str
) -> dict[str, Any]:
    """The DMP ranks at once; combined as the suite combines DDP ranks (samples summed, over
    the slowest rank's seconds), CPU seconds summed."""
    port = free_port()
    results = run_isolated(
        torchrec_rank,
        [(rank, ranks, port, workload, config) for rank in range(ranks)],
        timeout_s,
        start,
    )
    return {
        "samples": sum(r["samples"] for r in results),
        "seconds": max(r["seconds"] for r in results),
        "steps_per_rank": results[0]["steps"],
        "peak_rss_mb_per_trainer": [r["peak_rss_mb"] for r in results],
        "cpu_s": sum(r["cpu_s"] for r in results),
        "train_cpu_s": sum(r["train_cpu_s"] for r in results),
        "metrics": results[0]["metrics"],
    }


def probe() -> dict[str, str]:
    """Each optional package's version, or why it does not import (in a process of its own:
    a CUDA build of fbgemm_gpu can fail on loading its libraries)."""
    found = {}
    for name in ("fbgemm_gpu", "torchrec"):
        try:
            module = __import__(name)
            found[name] = f"ok {getattr(module, '__version__', '?')}"
        except Exception as error:  # an ImportError, or an OSError from a missing library
            found[name] = f"{type(error).__name__}: {error}".splitlines()[0]
    return found
