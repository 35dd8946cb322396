"""TorchRec and FBGEMM as a measured reference: the bench suite's DLRM on their CPU paths, beside
plain PyTorch and paramserver, side by side in one run.

The model and data are the suite's ``dlrm`` workload (:class:`workloads.ClickWorkload`: 8 tables
x ``--rows`` x 32, batches of 1024, synthetic click logs with Zipf ids), one torch thread per
process, one optimizer everywhere (``--optimizer``): Adagrad at the suite's lr (0.05, eps 1e-10;
the default), or plain SGD (no momentum) at the same lr. Every entry starts from the same values:
the dense layers of the suite's seeded DLRM and its tables' row initialisation. Entries:

- ``single_process``: plain PyTorch in one process, sparse embedding gradients, torch.optim's
  Adagrad or SGD (:func:`systems.single_process`, as ``bench_suite.py`` runs it);
- ``ps_async``: paramserver, 1 server + 1 trainer, async (:func:`systems.paramserver_job`), its
  ``adagrad`` or ``sgd`` rule for the dense parameters and the tables alike;
- ``fbgemm_fused``: one process; the 8 tables as one FBGEMM CPU
  ``SplitTableBatchedEmbeddingBagsCodegen`` with ``EXACT_ADAGRAD`` or ``EXACT_SGD`` fused into
  the backward pass (element-wise Adagrad or plain SGD on the rows' summed gradients, the update
  torch.optim's makes in the other entries; FBGEMM's CPU TBE has no Adam), each table looked up
  with one id per sample (sum pooling over bags of length 1, a plain lookup); the dense layers
  with torch.optim's Adagrad or SGD;
- ``torchrec_dmp``: TorchRec's ``DistributedModelParallel`` on ``--ranks`` CPU ranks (gloo on
  127.0.0.1), table-wise sharding (the tables in contiguous blocks, one per rank), the same fused
  update (``apply_optimizer_in_backward(torch.optim.Adagrad)`` or ``(torch.optim.SGD)``, which
  TorchRec maps to ``EXACT_ADAGRAD`` / ``EXACT_SGD``), the dense part data-parallel as DMP makes
  it (DDP, gradients averaged) with torch.optim's Adagrad or SGD. Rank ``r`` trains batches
  ``r, r + ranks, ...`` of the same stream.

Every entry trains on the same ``--steps`` batches (``torchrec_dmp``: ``steps / ranks`` per
rank, each step applying every rank's batch at once). Each runs in new processes of its own
(:func:`systems.run_isolated`); repeats (``--repeats``) alternate the order of entries and report
medians. Reported per entry: samples/s over the training seconds (the slowest rank's), its ratio
to ``ps_async`` and to ``single_process``, CPU seconds per sample summed over every process of
the entry (``cpu_s_per_sample``: from the start of the entry's work to its end, building,
training and evaluating; ``train_cpu_s_per_sample``: the training loop alone, where the entry's
own loop is here to measure), peak RSS per process, held-out AUC. Writes JSON (``--out``).

    .venv/bin/python benchmarks/bench_torchrec.py --quick    # smoke run: tiny sizes, seconds
    .venv/bin/python benchmarks/bench_torchrec.py --repeats 3 \\
        --out benchmarks/results/bench_torchrec.json
    .venv/bin/python benchmarks/bench_torchrec.py --optimizer sgd --repeats 3 \\
        --out benchmarks/results/bench_torchrec_sgd.json

TorchRec and FBGEMM are not dependencies of the project. Where either does not import, the
script says so in one line and runs the entries it can. To install them into .venv on CPU
(their CUDA builds do not load on a CPU-only torch; torchrec pins torchmetrics 1.0.3, below the
project's floor, so its dependencies go in by hand):

    .venv/bin/pip install -c constraints.txt tensordict tqdm pyre-extensions
    .venv/bin/pip install -c constraints.txt --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
from report import machine, save
from systems import (
    LOSS,
    START_METHODS,
    EntryFailed,
    free_port,
    paramserver_job,
    peak_rss_mb,
    run_isolated,
    single_process,
)
from torch import Tensor, nn
from workloads import ClickWorkload

import paramserver as ps
from paramserver.metrics import binary_metrics, evaluate_binary
from paramserver.modelplan import build_model
from paramserver.models.dlrm import DLRM
from paramserver.tableinit import RowInit

SYSTEMS = ("single_process", "ps_async", "fbgemm_fused", "torchrec_dmp")
NEEDS = {"fbgemm_fused": ("fbgemm_gpu",), "torchrec_dmp": ("fbgemm_gpu", "torchrec")}
LR = 0.05  # the suite's dlrm lr, for either optimizer
EPS = 1e-10  # torch.optim.Adagrad's, which paramserver's adagrad resolves to as well
OPTIMIZERS = ("adagrad", "sgd")
INSTALL = (
    ".venv/bin/pip install -c constraints.txt tensordict tqdm pyre-extensions && "
    ".venv/bin/pip install -c constraints.txt --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0"
)
QUICK = {
    "rows": 10_000,
    "batch": 256,
    "steps": 4,
    "ps_launcher": "threads",
    "start_method": "forkserver",
}
NOTES = [
    "samples/s: samples trained over the training seconds (first batch to last update; the "
    "slowest process's for multi-process entries). x ps / x single: over ps_async / "
    "single_process in this run.",
    "cpu_s_per_sample: user + system CPU seconds of every process of the entry from the start "
    "of its work to its end (building the model, training, evaluating; for ps_async with its "
    "processes launcher also the server and trainer interpreters' start and imports), over the "
    "samples trained. Imports of torchrec / fbgemm_gpu in the entry's own processes are not "
    "counted. train_cpu_s_per_sample: the training loop alone, summed over ranks; measured "
    "only where the loop is this script's (fbgemm_fused, torchrec_dmp).",
    "Optimizer: one everywhere (workload.optimizer), at lr 0.05: Adagrad (eps 1e-10, "
    "element-wise state) or plain SGD (no momentum). FBGEMM and TorchRec apply it to the tables "
    "inside the backward pass (EXACT_ADAGRAD / EXACT_SGD: gradients summed per row first), "
    "torch.optim's to the dense layers.",
    "torchrec_dmp: each step applies every rank's batch at once (dense gradients averaged by "
    "DDP, table gradients summed into the owning rank's tables), so it makes 1/ranks as many "
    "updates as the other entries on the same samples: its AUC differs for that reason too.",
    "peak RSS: ru_maxrss of each training process right after training, before evaluation.",
]
QUICK_NOTE = (
    "SMOKE RUN (--quick): tiny sizes, paramserver on its threads launcher, processes forked "
    "from a fork server: no figure here means anything."
)


# -- the models ---------------------------------------------------------------------------------


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


def metered(target: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``target(*args)`` (a :mod:`systems` entry) with the CPU seconds it took, its children's
    included."""
    started = cpu_seconds()
    result = target(*args)
    result["cpu_s"] = cpu_seconds() - started
    return result


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


# -- the driver ---------------------------------------------------------------------------------


def run_entry(system: str, workload: ClickWorkload, args: argparse.Namespace) -> dict[str, Any]:
    config = ps.TrainConfig(
        servers=1,
        trainers=1,
        steps=args.steps,
        mode="async",
        optimizer=args.optimizer,
        lr=workload.lr,
        progress=False,
        threads_per_process=1,
        launcher=args.ps_launcher,
    )
    limits = (args.timeout, args.start_method)
    if system == "single_process":
        (result,) = run_isolated(metered, [(single_process, workload, config)], *limits)
    elif system == "ps_async":
        (result,) = run_isolated(metered, [(paramserver_job, workload, config, False)], *limits)
    elif system == "fbgemm_fused":
        (result,) = run_isolated(fbgemm_fused, [(workload, config)], *limits)
    else:
        result = run_torchrec(workload, config, args.ranks, *limits)
    result["samples_per_s"] = result["samples"] / result["seconds"]
    result["cpu_s_per_sample"] = result["cpu_s"] / result["samples"]
    if "train_cpu_s" in result:
        result["train_cpu_s_per_sample"] = result["train_cpu_s"] / result["samples"]
    return result


def available(systems: Sequence[str], args: argparse.Namespace) -> tuple[list[str], dict]:
    """The systems whose packages import, and what the probe found."""
    needed = {package for system in systems for package in NEEDS.get(system, ())}
    if not needed:
        return list(systems), {}
    try:
        (found,) = run_isolated(probe, [()], args.timeout, args.start_method)
    except EntryFailed as error:
        found = {package: f"the import crashed its process ({error})" for package in needed}
    missing = {p: why for p, why in found.items() if p in needed and not why.startswith("ok")}
    if missing:
        skipped = [s for s in systems if set(NEEDS.get(s, ())) & set(missing)]
        reasons = "; ".join(f"{p}: {why}" for p, why in missing.items())
        print(
            f"[bench_torchrec] skipping {', '.join(skipped)}: {reasons}. "
            f"Install into .venv (CPU builds): {INSTALL}",
            flush=True,
        )
    return [s for s in systems if not set(NEEDS.get(s, ())) & set(missing)], found


def summarise(plan: list[str], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each entry's median run (by samples/s), with its ratios to the references' medians."""

    def median_rate(system: str) -> float | None:
        if system not in runs:
            return None
        return statistics.median(r["samples_per_s"] for r in runs[system])

    references = {"ps_async": median_rate("ps_async"), "single": median_rate("single_process")}
    entries = []
    for system in plan:
        rates = [r["samples_per_s"] for r in runs[system]]
        median = sorted(runs[system], key=lambda r: r["samples_per_s"])[len(rates) // 2]
        ratios = {
            f"speed_vs_{name}": median["samples_per_s"] / rate if rate else None
            for name, rate in references.items()
        }
        entries.append({"system": system, **median, **ratios, "all_samples_per_s": rates})
    return entries


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = os.getloadavg()
    workload = ClickWorkload(
        name="dlrm", rows=args.rows, batch_size=args.batch, train_batches=args.steps, lr=LR
    )
    chosen = [s for s in SYSTEMS if not args.only or s in args.only.split(",")]
    plan, packages = available(chosen, args)
    runs: dict[str, list[dict[str, Any]]] = {}
    # Forwards, then backwards, and so on: a drifting load hits early and late entries alike.
    for repeat in range(args.repeats):
        for system in plan if repeat % 2 == 0 else reversed(plan):
            print(f"[bench_torchrec] {system}: {args.steps} batches", flush=True)
            entry_started = time.perf_counter()
            result = run_entry(system, workload, args)
            result["entry_wall_s"] = time.perf_counter() - entry_started
            print(
                f"[bench_torchrec] {system}: {result['samples_per_s']:,.0f} samples/s, "
                f"{result['cpu_s_per_sample'] * 1e6:.1f} CPU us/sample, AUC "
                f"{result['metrics']['auc']:.4f}; {result['entry_wall_s']:.1f} s in all",
                flush=True,
            )
            runs.setdefault(system, []).append(result)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **machine(),
            "threads_per_process": 1,  # each entry's processes, not this driver's
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "packages": packages,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": {
            "tables": workload.num_tables,
            "rows": workload.rows,
            "dim": workload.embedding_dim,
            "batch_size": workload.batch_size,
            "batches": workload.train_batches,
            "lr": workload.lr,
            "optimizer": args.optimizer,
            "fused_table_optimizer": f"EXACT_{args.optimizer.upper()}",  # FBGEMM's, TorchRec's
            "ceiling_auc": workload.ceiling_auc(),
        },
        "skipped": [s for s in chosen if s not in plan],
        "entries": summarise(plan, runs),
        "seconds": time.perf_counter() - started,
        "notes": [QUICK_NOTE, *NOTES] if args.quick else NOTES,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="batches every entry trains on")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--batch", type=int, default=1024, help="batch size")
    parser.add_argument("--ranks", type=int, default=2, help="torchrec_dmp's ranks")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adagrad",
        help=f"every entry's update rule, dense layers and tables, at lr {LR}",
    )
    parser.add_argument(
        "--ps-launcher",
        choices=("processes", "threads"),
        default="processes",
        help="paramserver's launcher; threads (one process) only suits smoke runs",
    )
    parser.add_argument("--start-method", choices=START_METHODS, default="spawn")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each entry (median)")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated entries to run (default: {SYSTEMS})"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one entry may run")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    parser.add_argument("--out", default="bench_torchrec.json", help="JSON results")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for flag in ("steps", "rows", "batch", "ranks", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if args.steps % args.ranks:
        parser.error(f"--steps must be a multiple of --ranks ({args.ranks}): ranks step together")
    if args.only and (unknown := set(args.only.split(",")) - set(SYSTEMS)):
        parser.error(f"--only: unknown entries {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = run_bench(args)
    save(results, args.out)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
