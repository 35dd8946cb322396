"""The systems the bench suite compares, each run in fresh processes with a hard deadline.

Every entry runs in processes of its own (:func:`run_isolated`), so a figure such as peak
resident memory belongs to that system alone, not to the driver or to an earlier entry:

- :func:`single_process`: plain PyTorch in one process (sparse embedding gradients);
- :func:`paramserver_job`: one ``paramserver.train`` job; its launcher starts and supervises the
  servers and trainers, which die with it (``PR_SET_PDEATHSIG``);
- :func:`ddp_rank`: one rank of DistributedDataParallel over gloo on 127.0.0.1.

Each returns a JSON-able dict: ``samples``, ``seconds`` (training only, from the first batch to
the last update), peak RSS in MB measured right after training (before evaluation), and on the
process that evaluates, the held-out ``metrics``.

What a DDP rank counts as its bytes per step: the gradient bytes it hands to all-reduce, counted
in a communication hook. Dense gradients count whole (``numel x 4``, the flat buckets). A sparse
gradient counts as gloo sends it: coalesced (unique rows), int64 indices plus float32 values.
The hook coalesces it itself (gloo would otherwise do so) so the count costs no extra work.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime,
# against the classes themselves (dist.GradBucket, Future[Tensor]).
import json
import multiprocessing
import multiprocessing.connection
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel
from workloads import Workload

import paramserver as ps
from paramserver.baseline import make_optimizers, train_single_process
from paramserver.launch.worker import die_with_parent
from paramserver.metrics import evaluate_binary
from paramserver.modelplan import EMBEDDINGS, initial_model
from paramserver.observe import peak_rss_bytes
from paramserver.types import as_tuple

LOSS = F.binary_cross_entropy_with_logits

START_METHODS = ("spawn", "forkserver")


def start_context(
    start_method: str,
) -> multiprocessing.context.SpawnContext | multiprocessing.context.ForkServerContext:
    """How entries' processes start. ``spawn``: a fresh interpreter each (seconds of imports).
    ``forkserver``: forked from a server that imported this module (torch, paramserver, the
    workloads) once and nothing else: fast, and holding none of the driver's memory or threads,
    but the shared libraries' pages count in ru_maxrss only once touched, so peak RSS reads
    about 70 MB lower than a fresh interpreter's (paramserver's workers are fresh ones)."""
    if start_method == "spawn":
        return multiprocessing.get_context("spawn")
    if start_method == "forkserver":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["systems"])
        return context
    raise ValueError(f"start method {start_method!r}: choose from {START_METHODS}")


class EntryFailed(RuntimeError):
    """A process of an entry failed or ran past its deadline (every process was then killed)."""


def run_isolated(
    target: Callable[..., dict[str, Any]],
    calls: Sequence[tuple[Any, ...]],
    timeout_s: float,
    start_method: str = "spawn",
) -> list[dict[str, Any]]:
    """``target(*args)`` for each ``args`` of ``calls``, each in a new process started by
    ``start_method`` (see :func:`start_context`), all at once; returns their results in order.

    Blocks until every process has exited. When one fails or ``timeout_s`` passes, SIGKILLs
    every process this call started that is still running (by its pid) and raises
    :class:`EntryFailed`.
    """
    context = start_context(start_method)
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        paths = [Path(tmp) / f"{i}.json" for i in range(len(calls))]
        processes = [
            context.Process(target=_write_result, args=(target, args, path), daemon=True)
            for args, path in zip(calls, paths, strict=True)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        failure = None
        try:
            running = list(processes)
            while running and failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    failure = f"ran past its {timeout_s:g} s deadline"
                    break
                multiprocessing.connection.wait([p.sentinel for p in running], timeout=left)
                for process in [p for p in running if p.exitcode is not None]:
                    running.remove(process)
                    if process.exitcode != 0:
                        failure = f"process {process.pid} exited with {process.exitcode}"
        finally:
            for process in processes:
                if process.exitcode is None:
                    process.kill()
                process.join()
        if failure is not None:
            raise EntryFailed(f"{target.__name__}: {failure}")
        return [json.loads(path.read_text()) for path in paths]


def _write_result(target: Callable[..., dict[str, Any]], args: tuple[Any, ...], path: Path) -> None:
    # Die with the parent (the driver, or the fork server, which exits with the driver), and
    # with this process the paramserver workers it started: a killed driver leaves no orphans.
    die_with_parent(os.getppid())
    warnings.filterwarnings("ignore", message="Sparse invariant checks")
    result = target(*args)
    path.write_text(json.dumps(result))


def peak_rss_mb() -> float:
    return peak_rss_bytes() / 2**20


def single_process(workload: Workload, config: ps.TrainConfig) -> dict[str, Any]:
    """Plain PyTorch on every trainer's batches, interleaved (``config.steps`` per trainer)."""
    model, stats = train_single_process(workload.model, workload.train_stream, LOSS, config)
    peak = peak_rss_mb()
    return {
        "samples": stats["samples"],
        "seconds": stats["seconds"],
        "peak_rss_mb_per_trainer": [peak],
        "bytes_per_step": {},
        "metrics": evaluate_binary(model, workload.held_out()),
    }


def paramserver_job(workload: Workload, config: ps.TrainConfig, naive: bool) -> dict[str, Any]:
    """One paramserver job; ``naive`` serves the model with plain dense tables instead."""
    torch.set_num_threads(config.threads_per_process)
    model_fn = workload.naive_model if naive else workload.model
    result = ps.train(model_fn, workload.train_stream, LOSS, config)
    assert result is not None and result.model is not None
    summary = result.summary
    bytes_per_step = dict(summary["bytes_per_step"])
    if config.dense_sync == "allreduce":  # what a trainer handed to all-reduce, as DDP's hook
        calls = summary["calls"]
        steps = sum(summary["trainer_steps"])
        bytes_per_step["allreduce"] = calls["allreduce"]["sent_bytes"] / steps
        # The share of the all-reduce's time the step waited for (the rest overlapped).
        waited, took = (calls[op]["p50_ms"] for op in ("allreduce_wait", "allreduce"))
        result_extra = {"allreduce_waited_share": waited / took if took else 0.0}
    else:
        result_extra = {}
    return {
        "samples": summary["samples"],
        "seconds": summary["train_seconds"],
        "wall_s": summary["wall_s"],
        "peak_rss_mb_per_trainer": summary["peak_rss_mb_per_trainer"],
        "bytes_per_step": bytes_per_step,
        "mean_staleness": _mean(summary["staleness"]),
        **result_extra,
        "metrics": evaluate_binary(result.model, workload.held_out()),
    }


def _mean(histogram: dict[str, int]) -> float:
    total = sum(histogram.values())
    return sum(int(age) * n for age, n in histogram.items()) / total if total else 0.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class AllreduceBytes:
    """What one rank has handed to all-reduce so far (see the module docstring)."""

    world_size: int
    total: int = 0


def count_and_allreduce(state: AllreduceBytes, bucket: dist.GradBucket) -> Future[Tensor]:
    """DDP's default hook (mean over ranks by all-reduce), counting the bytes it hands over."""
    grad = bucket.buffer()
    if grad.is_sparse:
        grad = grad.coalesce()  # what gloo does first anyway
        state.total += grad.indices().nbytes + grad.values().nbytes
    else:
        state.total += grad.nbytes
    grad.div_(state.world_size)
    work = dist.all_reduce(grad, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def ddp_rank(
    rank: int,
    world_size: int,
    port: int,
    workload: Workload,
    config: ps.TrainConfig,
    sparse: bool,
) -> dict[str, Any]:
    """One DDP rank: ``config.steps`` steps on ``workload.train_stream(rank, world_size)``.

    Tables produce sparse gradients with ``sparse`` (Adagrad takes them) and dense ones
    otherwise; optimizers as :func:`paramserver.baseline.make_optimizers` builds them. Rank 0
    evaluates the final model.
    """
    torch.set_num_threads(config.threads_per_process)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        model = initial_model(workload.model, config.seed)
        optimizers = make_optimizers(model, config)  # marks the tables sparse
        for module in model.modules():
            if isinstance(module, EMBEDDINGS):
                module.sparse = sparse
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        sent = AllreduceBytes(world_size)
        ddp.register_comm_hook(sent, count_and_allreduce)
        batches = islice(workload.train_stream(rank, world_size), config.steps)
        samples = steps = 0
        dist.barrier()
        started = time.perf_counter()
        for inputs, target in batches:
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            LOSS(ddp(*as_tuple(inputs)), target).backward()
            for optimizer in optimizers:
                optimizer.step()
            samples += int(target.shape[0])
            steps += 1
        seconds = time.perf_counter() - started
        result: dict[str, Any] = {
            "samples": samples,
            "seconds": seconds,
            "steps": steps,
            "peak_rss_mb": peak_rss_mb(),
            "allreduce_bytes_per_step": sent.total / max(steps, 1),
        }
        dist.barrier()  # leave together: a rank that exits early can abort its peers' gloo
    finally:
        dist.destroy_process_group()
    # Only rank 0 evaluates, once the group is gone (no collective may wait on it).
    if rank == 0:
        result["metrics"] = evaluate_binary(model, workload.held_out())
    return result


def run_ddp(
    workload: Workload,
    config: ps.TrainConfig,
    sparse: bool,
    timeout_s: float,
    start_method: str = "spawn",
) -> dict[str, Any]:
    """``config.trainers`` DDP ranks at once; their figures combined as paramserver's summary
    combines its trainers' (samples summed, over the slowest rank's seconds)."""
    port = free_port()
    world_size = config.trainers
    ranks = run_isolated(
        ddp_rank,
        [(rank, world_size, port, workload, config, sparse) for rank in range(world_size)],
        timeout_s,
        start_method,
    )
    return {
        "samples": sum(r["samples"] for r in ranks),
        "seconds": max(r["seconds"] for r in ranks),
        "peak_rss_mb_per_trainer": [r["peak_rss_mb"] for r in ranks],
        "bytes_per_step": {
            "allreduce": sum(r["allreduce_bytes_per_step"] for r in ranks) / world_size
        },
        "metrics": ranks[0]["metrics"],
    }
