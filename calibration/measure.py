"""Measure this machine for ``plan calibrate`` and write a cluster file.

:func:`run_calibration` measures, with one thread per process (one process per device):

* in rank 0 alone while the others wait: the reference ``ALONE_MATMUL_SIZE`` matmul, so the fit can
  tell how much slower a process computes when all of them run (``shared_slowdown``) — :func:`_alone_sample`;
* in every one of ``num_processes`` spawned gloo processes on 127.0.0.1 at once (:func:`_worker`; rank 0's
  figures are kept), so a device is what one process gets while all of them run — with more processes
  than cores each gets its share:

  * fp32 ``torch.mm`` of ``m×m`` matrices, ``2·m³`` FLOPs each — :func:`_measure_matmul`;
  * large tensor copies (``2·s`` bytes moved) and adds (``3·s``) — :func:`_measure_memory`;
  * the eager overhead of a tiny operator, forward and backward through autograd — :func:`_measure_op_overhead`;
* then between the same processes (timed on rank 0):
  all-reduce of ``b`` bytes, all-gather into ``b`` bytes, and send/recv ping-pong between ranks 0
  and 1 whose one-way time is half the round trip — :func:`_measure_collectives`.

Every sample is the median over ``repeats`` timed runs after a warm-up (:func:`_timed`). A collective
run is a barrier then one operation, timed on rank 0: back-to-back gloo collectives queue behind each
other and read several times slower than isolated ones. A matmul run is ``_inner_iterations``
back-to-back products divided out, so an 8×8 product is not timer noise.
:func:`calibration.fit.fit_calibration` fits the samples; :func:`write_cluster_file`
writes the result (JSON or TOML) atomically: a temporary file in the same folder, then ``os.replace``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue as queue_module
import socket
import statistics
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from calibration.fit import (
    ALONE_MATMUL_SIZE,
    MATMUL_ALONE_KIND,
    CalibrationResult,
    Sample,
    fit_calibration,
    to_toml,
)
from cost_models.cluster import Cluster
from executors.training.launch import free_port
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES_BYTES = (1 * KIB, 16 * KIB, 128 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
QUICK_SIZES_BYTES = (1 * KIB, 64 * KIB, 1 * MIB)
DEFAULT_REPEATS = 30
QUICK_REPEATS = 5
MATMUL_SIZES = (8, 64, 256, 512, 1024)
QUICK_MATMUL_SIZES = (8, 128, 512)
MEMORY_BYTES = 128 * MIB
QUICK_MEMORY_BYTES = 32 * MIB
WARMUP = 2
GROUP_WARMUP = 20
INIT_TIMEOUT_S = 60.0
HOST = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class _WorkerPlan:
    num_processes: int
    port: int
    sizes_bytes: tuple[int, ...]
    repeats: int
    quick: bool = False


def run_calibration(
    *,
    num_processes: int = 2,
    sizes_bytes: Sequence[int] | None = None,
    repeats: int | None = None,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
    timeout_s: float = 300.0,
) -> CalibrationResult:
    """Measure compute, memory and gloo collectives on this machine and fit them. (The executors' host
    overheads are fitted on probe plans by :func:`calibration.machine.calibrate_machine`.)"""
    sizes = tuple(sizes_bytes) if sizes_bytes is not None else (QUICK_SIZES_BYTES if quick else DEFAULT_SIZES_BYTES)
    repeats = repeats if repeats is not None else (QUICK_REPEATS if quick else DEFAULT_REPEATS)
    _check_options(num_processes=num_processes, sizes_bytes=sizes, repeats=repeats)
    report = progress if progress is not None else _ignore
    _report_load(report)
    plan = _WorkerPlan(num_processes=num_processes, port=free_port(), sizes_bytes=sizes, repeats=repeats, quick=quick)
    report(f"{num_processes} gloo processes on {HOST}:{plan.port}: compute in every process at once, then collectives")
    samples = _run_workers(plan, report=report, timeout_s=timeout_s)
    result = fit_calibration(
        samples,
        num_processes=num_processes,
        hostname=socket.gethostname(),
        torch_version=torch.__version__,
        date=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    for kind, link in result.links.items():
        report(f"fit {kind}: latency {link.latency_s * 1e6:.1f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s")
    report(
        f"fit compute: {result.matmul.peak_flops / 1e9:.1f} GFLOP/s, "
        f"kernel overhead {result.matmul.kernel_overhead_s * 1e6:.1f} us, "
        f"memory {result.memory_bandwidth / 1e9:.2f} GB/s"
    )
    return result


def _ignore(message: str) -> None:
    del message


def _report_load(report: Callable[[str], None]) -> None:
    """Say so when other processes keep the cores busy: they slow every measurement down."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return
    num_cores = os.cpu_count() or 1
    if load >= 0.5 * num_cores:
        report(f"note: load average {load:.1f} on {num_cores} cores: other processes will slow the measurements")


def _check_options(*, num_processes: int, sizes_bytes: tuple[int, ...], repeats: int) -> None:
    if num_processes < 2:
        raise AutoplanError(f"calibration needs at least 2 processes to measure collectives, got {num_processes}")
    if not sizes_bytes or any(size < 4 * num_processes for size in sizes_bytes):
        raise AutoplanError(f"calibration sizes must be at least {4 * num_processes} bytes each, got {sizes_bytes}")
    if repeats < 1:
        raise AutoplanError(f"calibration repeats must be at least 1, got {repeats}")


def _inner_iterations(work: float, *, per_run: float) -> int:
    """Back-to-back operations per timed run: enough that one run does about ``per_run`` work."""
    return max(1, min(1000, int(per_run // max(work, 1.0))))


def _timed(operation: Callable[[], Any], *, inner: int, repeats: int, sync: Callable[[], Any] | None = None) -> float:
    """Median seconds per ``operation`` over ``repeats`` runs of ``inner`` calls, after a warm-up."""
    for _ in range(WARMUP):
        operation()
    times = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        for _ in range(inner):
            operation()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _measure_local(*, quick: bool, repeats: int, report: Callable[[str], None]) -> list[Sample]:
    """Matmul and memory samples in this process, with one thread (restored afterwards)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = _measure_matmul(QUICK_MATMUL_SIZES if quick else MATMUL_SIZES, repeats=repeats, report=report)
        samples.append(_measure_op_overhead(repeats=repeats, report=report))
        return samples + _measure_memory(QUICK_MEMORY_BYTES if quick else MEMORY_BYTES, repeats=repeats, report=report)
    finally:
        torch.set_num_threads(threads)


def _measure_matmul(sizes: Sequence[int], *, repeats: int, report: Callable[[str], None]) -> list[Sample]:
    samples = [_matmul_sample(size, repeats=repeats) for size in sizes]
    for size, sample in zip(sizes, samples, strict=True):
        rate = sample.flops / sample.seconds / 1e9
        report(f"matmul {size}x{size} fp32: {rate:.1f} GFLOP/s ({sample.seconds * 1e6:.1f} us)")
    return samples


def _matmul_sample(size: int, *, repeats: int) -> Sample:
    left, right, out = torch.randn(size, size), torch.randn(size, size), torch.empty(size, size)
    flops = 2.0 * size**3
    inner = _inner_iterations(flops, per_run=2e8)
    seconds = _timed(lambda: torch.mm(left, right, out=out), inner=inner, repeats=repeats)
    return Sample(kind="matmul", num_devices=1, num_bytes=3 * size * size * 4, seconds=seconds, flops=flops)


def _alone_sample(*, repeats: int, report: Callable[[str], None]) -> Sample:
    """The reference matmul timed while this process runs alone (kind ``matmul_alone``)."""
    sample = replace(_matmul_sample(ALONE_MATMUL_SIZE, repeats=repeats), kind=MATMUL_ALONE_KIND)
    report(
        f"matmul {ALONE_MATMUL_SIZE}x{ALONE_MATMUL_SIZE} fp32 alone: {sample.flops / sample.seconds / 1e9:.1f} GFLOP/s"
    )
    return sample


OVERHEAD_CHAIN = 200  # tiny operators per timed run


def _measure_op_overhead(*, repeats: int, report: Callable[[str], None]) -> Sample:
    """Seconds per operator per pass of a chain of tiny elementwise operators through autograd."""
    leaf = torch.ones(16, requires_grad=True)

    def chain() -> None:
        value = leaf
        for _ in range(OVERHEAD_CHAIN):
            value = value * 1.0001
        value.sum().backward()

    seconds = _timed(chain, inner=1, repeats=repeats) / (2 * OVERHEAD_CHAIN)
    report(f"eager operator overhead: {seconds * 1e6:.1f} us per operator per pass")
    return Sample(kind="op_overhead", num_devices=1, num_bytes=0, seconds=seconds)


def _measure_memory(num_bytes: int, *, repeats: int, report: Callable[[str], None]) -> list[Sample]:
    source, other, out = (torch.full((num_bytes // 4,), value) for value in (1.0, 2.0, 0.0))
    copy_s = _timed(lambda: out.copy_(source), inner=1, repeats=repeats)
    add_s = _timed(lambda: torch.add(source, other, out=out), inner=1, repeats=repeats)
    samples = [
        Sample(kind="memory_copy", num_devices=1, num_bytes=2 * num_bytes, seconds=copy_s),
        Sample(kind="memory_add", num_devices=1, num_bytes=3 * num_bytes, seconds=add_s),
    ]
    for sample in samples:
        rate = sample.num_bytes / sample.seconds / 1e9
        report(f"{sample.kind} of {num_bytes // MIB} MiB: {rate:.2f} GB/s")
    return samples


def _run_workers(plan: _WorkerPlan, *, report: Callable[[str], None], timeout_s: float) -> list[Sample]:
    """Spawn the gloo ranks, relay their progress, and return rank 0's samples; fail loudly, never hang."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, plan, messages)) for rank in range(plan.num_processes)]
    for process in processes:
        process.start()
    try:
        rows = _collect(processes, messages, report=report, deadline=time.monotonic() + timeout_s)
        for process in processes:
            process.join(timeout=10.0)
    finally:
        _stop(processes)
    return [
        Sample(kind=kind, num_devices=num_devices, num_bytes=num_bytes, seconds=seconds, flops=flops)
        for kind, num_devices, num_bytes, seconds, flops in rows
    ]


def _collect(
    processes: list[Any], messages: Any, *, report: Callable[[str], None], deadline: float
) -> list[tuple[str, int, int, float, float]]:
    done: dict[int, list[tuple[str, int, int, float, float]]] = {}
    while len(done) < len(processes):
        if time.monotonic() > deadline:
            raise AutoplanError("calibration timed out waiting for its processes: retry with fewer sizes or repeats")
        try:
            status, rank, payload = messages.get(timeout=0.5)
        except queue_module.Empty:
            _check_alive(processes, done)
            continue
        if status == "error":
            raise AutoplanError(f"calibration process {rank} failed: {payload}")
        if status == "progress":
            report(payload)
        else:
            done[rank] = payload
    return done[0]


def _check_alive(processes: list[Any], done: dict[int, Any]) -> None:
    for rank, process in enumerate(processes):
        if rank not in done and process.exitcode is not None:
            raise AutoplanError(f"calibration process {rank} exited with code {process.exitcode} before reporting")


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)


def _worker(rank: int, plan: _WorkerPlan, messages: Any) -> None:
    """One gloo rank: measure, send rank 0's samples (or the error) to the parent."""
    try:
        os.environ["MASTER_ADDR"] = HOST
        os.environ["MASTER_PORT"] = str(plan.port)
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=plan.num_processes, timeout=timedelta(seconds=INIT_TIMEOUT_S)
        )
        try:
            dist.barrier()  # rank 0 alone first (the others wait in the barrier), for the shared slowdown
            alone = [_alone_sample(repeats=plan.repeats, report=_relay(rank, messages))] if rank == 0 else []
            dist.barrier()  # then every process measures its compute at the same time: devices share the cores
            local = _measure_local(quick=plan.quick, repeats=plan.repeats, report=_relay(rank, messages))
            rows = [(s.kind, s.num_devices, s.num_bytes, s.seconds, s.flops) for s in [*alone, *local] if rank == 0]
            rows += _measure_collectives(rank, plan, messages)
        finally:
            dist.destroy_process_group()
        messages.put(("done", rank, rows))
    except Exception as error:  # any failure must reach the parent, never leave it waiting
        detail = f"{type(error).__name__}: {error}".strip().splitlines()[0]
        messages.put(("error", rank, detail))


def _relay(rank: int, messages: Any) -> Callable[[str], None]:
    """Rank 0's progress lines go to the parent; the other ranks measure quietly."""

    def report(message: str) -> None:
        if rank == 0:
            messages.put(("progress", rank, message))

    return report


def _measure_collectives(rank: int, plan: _WorkerPlan, messages: Any) -> list[tuple[str, int, int, float, float]]:
    warm = torch.ones(max(1, KIB // 4))
    for _ in range(GROUP_WARMUP):  # the first collectives after start-up run several times slower
        dist.barrier()
        dist.all_reduce(warm)
    rows = []
    for size in plan.sizes_bytes:
        for kind, num_devices, num_bytes, seconds in _measure_size(rank, plan, size):
            rows.append((kind, num_devices, num_bytes, seconds, 0.0))
            if rank == 0:
                messages.put(("progress", rank, f"{kind} {_size_text(num_bytes)}: {seconds * 1e6:.1f} us"))
    return rows if rank == 0 else []


def _measure_size(rank: int, plan: _WorkerPlan, size: int) -> list[tuple[str, int, int, float]]:
    """All-reduce, all-gather and one-way p2p of ``size`` bytes (rounded to whole fp32 shards)."""
    n = plan.num_processes
    numel = max(1, size // 4 // n) * n
    full, part = torch.ones(numel), torch.ones(numel // n)
    operations = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: _all_gather(full, part),
        "p2p": lambda: _ping_pong(rank, full),
    }
    rows = []
    for kind, operation in operations.items():
        seconds = _timed(operation, inner=1, repeats=plan.repeats, sync=dist.barrier)
        if kind == "p2p":
            rows.append((kind, 2, numel * 4, seconds / 2))  # one way: half the round trip
        else:
            rows.append((kind, n, numel * 4, seconds))
    return rows


def _all_gather(output: torch.Tensor, shard: torch.Tensor) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the older name before 2.13
    gather(output, shard)


def _ping_pong(rank: int, tensor: torch.Tensor) -> None:
    """Rank 0 sends to rank 1 and waits for it to send back; the other ranks sit out."""
    if rank == 0:
        dist.send(tensor, dst=1)
        dist.recv(tensor, src=1)
    elif rank == 1:
        dist.recv(tensor, src=0)
        dist.send(tensor, dst=0)


def _size_text(num_bytes: int) -> str:
    if num_bytes >= MIB:
        return f"{num_bytes / MIB:g} MiB"
    return f"{num_bytes / KIB:g} KiB"


def check_output_path(path: str | Path) -> Path:
    """Fail before measuring when the cluster file could not be written."""
    path = Path(path)
    if path.suffix not in (".json", ".toml"):
        raise AutoplanError(f"cluster file {path} must end in .json or .toml")
    if not path.parent.is_dir():
        raise AutoplanError(f"folder {path.parent} for cluster file {path.name} does not exist: create it first")
    return path


def write_cluster_file(result: CalibrationResult, path: str | Path, *, base: Cluster | None = None) -> Path:
    """Write ``result`` as a cluster file (``.json`` or ``.toml``) atomically; return its path."""
    path = check_output_path(path)
    data = result.to_json(base)
    text = to_toml(data) if path.suffix == ".toml" else json.dumps(data, indent=2) + "\n"
    parsed = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    Cluster.from_json(parsed, source=str(path))  # never write a file that would not load back
    write_text_atomic(path, text, what="cluster file")
    return path
