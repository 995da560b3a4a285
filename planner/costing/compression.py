"""What a gradient-sync choice (:class:`planner.plan.GradSync`) costs, and where it can run.

The executors run torch's DDP communication hooks and model averager on the buckets of
:mod:`planner.costing.overlap` (DDP's own, or :mod:`executors.parallel.grad_sync`'s on sharded stages). A bucket of
``N`` gradient elements of ``b`` bytes (the optimizer's gradient itemsize), summed over a group of ``n``
devices on a link (α, β), costs — :func:`bucket_sync_s`:

* ``exact``: ``all_reduce(N·b)`` (:func:`cost_models.communication.all_reduce_s`), no compute;
* ``bf16`` (``bf16_compress_hook``): ``all_reduce(2N)``; compute :func:`bf16_compress_s`: the cast to bf16
  (read ``N·b``, write ``2N`` bytes), the division by ``n`` (read and write ``2N``) and the cast back (read
  ``2N``, write ``N·b``), at the device's streaming bandwidth. With 2-byte gradients it saves no bytes;
* ``powersgd`` rank ``r`` (``powerSGD_hook``): each gradient, viewed as ``n_i × m_i`` (``shape[0]`` × the
  rest), with ``r_i = min(n_i, m_i, r)``, is compressed when ``2·(n_i + m_i)·r_i < n_i·m_i`` (torch's
  ``_should_compress`` at ``min_compression_rate`` 2; 1-D gradients never are). Three all-reduces one after
  the other (:func:`powersgd_comm_s`): the uncompressed gradients, ``Σ n_i·r_i`` elements (the P factors)
  and ``Σ m_i·r_i`` (Q). Compute (:func:`powersgd_compress_s`), a roofline at the device's peak for the
  gradient dtype: per compressed matrix the GEMMs ``P = M·Q``, ``Q = Mᵀ·P`` and ``M = P·Qᵀ`` (``2·n·m·r``
  FLOPs each, each reading or writing ``M``) and two Gram-Schmidt orthogonalizations (``2·(n + m)·r²``
  FLOPs, ``2r + r(r−1)`` kernels each); over the whole bucket the error feedback (add the error: 3 passes,
  keep a copy: 2, the new error = copy − result: 3) and the uncompressed gradients' copies in and out (4
  passes of their bytes). Memory (:func:`sync_state_bytes`): one error-feedback buffer per bucket, its size;
* ``local-sgd`` period ``H`` (DDP only: ``post_localSGD_hook`` + ``PeriodicModelAverager``): every bucket is
  all-reduced exactly but only among the replicas on the same node (the node's devices of the group, the
  intra-node link: :func:`sync_groups`), and once every ``H`` steps the parameters (fp32 master weights, 4
  bytes each) are averaged over the whole group: one all-reduce plus flattening, dividing and copying back
  (6 passes of 4-byte parameters), amortised — :func:`local_sgd_average_s`;
* the gathered kinds (``topk``, ``onebit``, ``threshold``, ``terngrad``, ``qsgd``, ``signsgd``, ``dgc``: our own hook,
  :mod:`executors.compressed_sync`): an all-gather of every rank's compressed payloads (a sparse or quantized
  gradient cannot be summed on the wire), each rank decompressing and averaging all ``n`` of them —
  :func:`planner.costing.sync.gathered.gathered_sync_s` (its docstring states the bytes and passes of each
  kind, and threshold's assumed density). Memory: the error-feedback kinds' fp32 residuals
  (:func:`planner.costing.sync.gathered.gathered_state_bytes`);
* ``dga`` delay ``D`` (DDP only): the exact all-reduce, launched when its bucket is ready and waited for ``D``
  steps later, so ``D`` backwards hide it; the hook's copies and correction as compression compute, its queue of
  ``D + 1`` steps as memory — :mod:`planner.costing.sync.delayed`;
* ``ps`` servers ``S``, staleness ``K`` (DDP only): no bucket goes out during the backward; after it, the push to
  the servers, their optimizer step on the busiest shard (:attr:`StageSync.optimizer_share` of the plan's) and the
  pull — :mod:`planner.costing.sync.parameter_server`.

The compression compute runs on the device when its bucket goes out (:class:`planner.costing.overlap.SyncSegment`
``compress_s``: it delays the rest of the backward), the communication on the group's link. A bucket summed
over several mesh axes is synced one axis after the other, each with its own all-reduces and compression.
Steps before ``warmup_steps`` run exact; the estimate is the steady state after them.

:func:`stage_sync` puts this together for one stage: its buckets, ready times and their price — what both
the estimate (:mod:`planner.inter.pricing`) and the simulator (:mod:`planner.costing.lowering`) charge. Under a
runtime that keeps one gradient buffer (:mod:`planner.costing.runtime_profiles`: Megatron-LM's local DDP) a stage
has one bucket per process group, and under one that syncs after the backward every bucket is ready at the
backward's end, so nothing overlaps it.
:func:`refusal` says why a plan cannot run a choice exactly as priced (local SGD outside DDP, anything lossy
under FSDP; the gathered kinds run wherever PowerSGD does: on DDP's buckets and on the sharded or pipeline stages'
buckets).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_models.cluster import Cluster, Link
from cost_models.communication import all_reduce_s
from cost_models.memory import optimizer_bytes
from planner.costing.overlap import (
    GradEntry,
    ReadyBucket,
    SyncSegment,
    cut_backward,
    ddp_entries,
    runtime_buckets,
    stage_grad_entries,
)
from planner.costing.setup import CostSetup
from planner.costing.sync.delayed import delayed_copy_s, delayed_segments, delayed_state_bytes
from planner.costing.sync.gathered import gathered_state_bytes, gathered_sync_s
from planner.costing.sync.parameter_server import ps_sync
from planner.ir.graph import OpGraph
from planner.plan import GradSync, Stage
from planner.sharding.specs import StageMesh

EXACT = GradSync()
MASTER_WEIGHT_BYTES = 4  # the local-SGD averager averages the fp32 parameters the optimizer updates
AVERAGE_PASSES = 6  # flatten (read, write), divide (read, write), copy back (read, write)
ERROR_FEEDBACK_PASSES = 8  # add the error (3), keep a copy (2), error = copy − result (3)
MIN_COMPRESSION_RATE = 2  # torch's PowerSGDState default

Group = tuple[int, Link]  # devices and link of one all-reduce


@dataclass(frozen=True, kw_only=True)
class StageSync:
    """A stage's gradient sync under a choice: its last backward cut at its buckets (empty: nothing to sync)."""

    segments: tuple[SyncSegment, ...] = ()
    amortised_s: float = 0.0  # local SGD: the parameter average every H steps, per step
    state_bytes: float = 0.0  # PowerSGD and the gathered error-feedback kinds: their buffers per device
    optimizer_share: float = 1.0  # ps: the share of the optimizer step the busiest server runs

    @property
    def comm_s(self) -> float:
        return math.fsum(segment.all_reduce_s for segment in self.segments)

    @property
    def hidden_s(self) -> float:
        """The communication later steps hide (DGA's delay, a stale parameter server's push), off the step."""
        return math.fsum(segment.hidden_s for segment in self.segments)


def refusal(
    grad_sync: GradSync, stages: Sequence[Stage], *, zero: bool, cluster: Cluster, ddp: bool, optimizer: str
) -> str | None:
    """Why the plan of ``stages`` cannot run ``grad_sync`` exactly as priced (None: it can)."""
    if not grad_sync.lossy:
        return None
    if zero:
        return f"{grad_sync.label} runs on DDP's or the sharded stages' buckets, not under FSDP (--zero)"
    if grad_sync.kind == "dgc" and optimizer != "sgd-momentum":
        return (
            f"DGC keeps SGD's momentum in the gradient sync (momentum correction): it runs with --optimizer "
            f"sgd-momentum, not {optimizer}"
        )
    if grad_sync.kind == "ps" and not ddp:
        return "a parameter server updates whole replicas: only a one-stage data-parallel plan (DDP) can run it"
    if grad_sync.kind == "ps" and grad_sync.servers > len(stages[0].devices):
        return f"{grad_sync.servers} servers for {len(stages[0].devices)} replicas: each server is a replica's rank"
    if grad_sync.kind == "dga" and not ddp:
        return "DGA steps each replica on its own gradient: only a one-stage data-parallel plan (DDP) can run it"
    if grad_sync.kind == "local-sgd":
        if not ddp:
            return "local SGD averages whole replicas: only a one-stage data-parallel plan (DDP) can run it"
        nodes = {cluster.node_of(rank) for rank in stages[0].devices}
        if len(nodes) < 2:
            return "local SGD averages replicas across nodes: this plan's replicas are all on one node"
    return None


def requirements(grad_sync: GradSync) -> str:
    """What a plan needs to run ``grad_sync`` (:func:`refusal`'s rules in words), for a refusal's message."""
    needs = ["replicas on several devices", "without --zero"]
    if grad_sync.kind == "local-sgd":
        needs[0] = "a one-stage data-parallel plan (DDP) with replicas on several nodes"
    if grad_sync.kind in ("dga", "ps"):
        needs[0] = "a one-stage data-parallel plan (DDP)"
    if grad_sync.kind == "ps":
        needs[0] += f" with at least {grad_sync.servers} replicas"
    if grad_sync.kind == "dgc":
        needs.append("with --optimizer sgd-momentum (DGC keeps its momentum)")
    return ", ".join(needs)


def sync_groups(grad_sync: GradSync, bucket_axes: Sequence[int], *, mesh: StageMesh, ddp: bool) -> list[Group]:
    """The all-reduces of a bucket, one per mesh axis (DDP: one over the group; local SGD: within each node)."""
    if not ddp:
        return [(mesh.mesh_shape[axis], mesh.link(axis)) for axis in bucket_axes]
    cluster, devices = mesh.cluster, mesh.devices
    if grad_sync.kind == "local-sgd":
        per_node = max(
            sum(1 for rank in devices if cluster.node_of(rank) == node)
            for node in {cluster.node_of(rank) for rank in devices}
        )
        return [(per_node, cluster.intra_node)]
    return [(len(devices), cluster.link_between(devices))]


def bucket_sync_s(
    entries: Sequence[GradEntry], groups: Sequence[Group], grad_sync: GradSync, setup: CostSetup
) -> tuple[float, float]:
    """(communication s, compression compute s) of one bucket under ``grad_sync`` (module docstring)."""
    itemsize = optimizer_bytes(setup.optimizer).grads
    numel = sum(entry.numel for entry in entries)
    comm = compress = 0.0
    for devices, link in groups:
        if devices <= 1:
            continue
        if grad_sync.kind == "bf16":
            comm += all_reduce_s(2 * numel, num_devices=devices, link=link)
            compress += bf16_compress_s(numel, itemsize=itemsize, setup=setup)
        elif grad_sync.kind == "powersgd":
            comm += powersgd_comm_s(entries, rank=grad_sync.rank, itemsize=itemsize, devices=devices, link=link)
            compress += powersgd_compress_s(entries, rank=grad_sync.rank, itemsize=itemsize, setup=setup)
        elif grad_sync.gathered:
            group_comm, group_compress = gathered_sync_s(entries, grad_sync, devices=devices, link=link, setup=setup)
            comm, compress = comm + group_comm, compress + group_compress
        elif grad_sync.kind == "dga":  # the exact all-reduce, hidden later (planner.costing.sync.delayed)
            comm += all_reduce_s(numel * itemsize, num_devices=devices, link=link)
            compress += delayed_copy_s(numel, itemsize=itemsize, setup=setup)
        else:
            comm += all_reduce_s(numel * itemsize, num_devices=devices, link=link)
    return comm, compress


def bf16_compress_s(numel: int, *, itemsize: float, setup: CostSetup) -> float:
    """Cast to bf16, divide, cast back: ``2·N·b + 8·N`` bytes at the streaming bandwidth, three kernels."""
    device = setup.cluster.device
    moved = 2 * numel * itemsize + 8 * numel
    return moved / (device.memory_bandwidth * device.memory_efficiency) + 3 * device.kernel_overhead_s


def _matrix(entry: GradEntry) -> tuple[int, int]:
    rows = entry.shape[0] if entry.shape else 1
    return rows, max(1, entry.numel // max(rows, 1))


def compressed(entry: GradEntry, rank: int) -> bool:
    """torch's ``_should_compress``: the factors are at most half the matrix."""
    n, m = _matrix(entry)
    r = min(n, m, rank)
    return (n + m) * r * MIN_COMPRESSION_RATE < n * m


def powersgd_comm_s(entries: Sequence[GradEntry], *, rank: int, itemsize: float, devices: int, link: Link) -> float:
    """The three all-reduces of a bucket: its uncompressed gradients, then the P factors, then the Q factors."""
    plain = sum(entry.numel for entry in entries if not compressed(entry, rank))
    p = q = 0
    for entry in entries:
        if compressed(entry, rank):
            n, m = _matrix(entry)
            r = min(n, m, rank)
            p, q = p + n * r, q + m * r
    return sum(all_reduce_s(count * itemsize, num_devices=devices, link=link) for count in (plain, p, q))


def powersgd_compress_s(entries: Sequence[GradEntry], *, rank: int, itemsize: float, setup: CostSetup) -> float:
    """PowerSGD's compute for one bucket on one device (module docstring)."""
    device = setup.cluster.device
    bandwidth = device.memory_bandwidth * device.memory_efficiency
    peak = device.peak("bfloat16" if itemsize == 2 else "float32") * device.compute_efficiency
    total = sum(entry.numel for entry in entries) * itemsize * ERROR_FEEDBACK_PASSES / bandwidth
    total += 3 * device.kernel_overhead_s
    for entry in entries:
        n, m = _matrix(entry)
        if not compressed(entry, rank):
            total += 4 * entry.numel * itemsize / bandwidth
            continue
        r = min(n, m, rank)
        gemm_bytes = (n * m + (n + m) * r) * itemsize
        total += 3 * max(2 * n * m * r / peak, gemm_bytes / bandwidth)
        total += 2 * (n + m) * r * r / peak
        total += (3 + 2 * (2 * r + r * (r - 1))) * device.kernel_overhead_s
    return total


def local_sgd_average_s(num_params: int, *, period: int, devices: int, link: Link, setup: CostSetup) -> float:
    """``PeriodicModelAverager`` every ``period`` steps over the whole group, per step."""
    device = setup.cluster.device
    moved = AVERAGE_PASSES * num_params * MASTER_WEIGHT_BYTES / (device.memory_bandwidth * device.memory_efficiency)
    return (all_reduce_s(num_params * MASTER_WEIGHT_BYTES, num_devices=devices, link=link) + moved) / period


def sync_state_bytes(buckets: Sequence[ReadyBucket], grad_sync: GradSync, *, itemsize: float) -> float:
    """Error-feedback buffers: PowerSGD's one bucket-sized buffer per bucket (P and Q are far smaller), the
    gathered kinds' fp32 residuals (:func:`planner.costing.sync.gathered.gathered_state_bytes`)."""
    if grad_sync.gathered:
        return gathered_state_bytes(buckets, grad_sync)
    if grad_sync.kind == "dga":
        return delayed_state_bytes(buckets, delay=grad_sync.delay, itemsize=itemsize)
    if grad_sync.kind != "powersgd":
        return 0.0
    return sum(bucket.numel for bucket in buckets) * itemsize


def stage_sync(
    stage: Stage, graph: OpGraph, bwd_s: Mapping[str, float], setup: CostSetup, *, grad_sync: GradSync, ddp: bool
) -> StageSync:
    """The stage's buckets cut into its last backward and priced under ``grad_sync`` (``graph`` holds the
    stage's nodes; ``bwd_s`` each node's backward seconds); ``ddp``: the stage runs as DDP."""
    mesh = StageMesh(cluster=setup.cluster, devices=stage.devices, mesh_shape=stage.mesh_shape)
    itemsize = optimizer_bytes(setup.optimizer).grads
    entries = ddp_entries(graph) if ddp else stage_grad_entries(stage, graph)
    if not entries or len(stage.devices) == 1:
        return StageSync()
    if grad_sync.kind == "ps":
        return _ps_stage_sync(stage, entries, bwd_s, setup, grad_sync=grad_sync)
    buckets, backward = runtime_buckets(
        graph, list(stage.nodes), entries, bwd_s, grad_itemsize=itemsize, runtime=setup.runtime
    )

    def price(bucket: ReadyBucket) -> tuple[float, float]:
        groups = sync_groups(grad_sync, bucket.axes, mesh=mesh, ddp=ddp)
        return bucket_sync_s(bucket.entries, groups, grad_sync, setup)

    amortised = 0.0
    if grad_sync.kind == "local-sgd":
        amortised = local_sgd_average_s(
            sum(entry.numel for entry in entries),
            period=grad_sync.period,
            devices=len(stage.devices),
            link=setup.cluster.link_between(stage.devices),
            setup=setup,
        )
    segments = cut_backward(buckets, backward, price)
    if grad_sync.kind == "dga":
        segments = delayed_segments(segments, backward_s=backward, delay=grad_sync.delay)
    return StageSync(
        segments=tuple(segments),
        amortised_s=amortised,
        state_bytes=sync_state_bytes(buckets, grad_sync, itemsize=itemsize),
    )


def _ps_stage_sync(
    stage: Stage, entries: Sequence[GradEntry], bwd_s: Mapping[str, float], setup: CostSetup, *, grad_sync: GradSync
) -> StageSync:
    """A parameter server's step (:func:`planner.costing.sync.parameter_server.ps_sync`) as one sync after the
    whole backward: no bucket overlaps it."""
    backward = math.fsum(bwd_s.values())
    price = ps_sync(
        [entry.numel for entry in entries],
        devices=stage.devices,
        servers=grad_sync.servers,
        staleness=grad_sync.staleness,
        backward_s=backward,
        setup=setup,
    )
    after = SyncSegment(
        backward_s=backward, all_reduce_s=price.exposed_s, compress_s=price.copy_s, hidden_s=price.hidden_s
    )
    return StageSync(
        segments=(after, SyncSegment(backward_s=0.0, all_reduce_s=0.0)),
        optimizer_share=price.optimizer_share,
        state_bytes=price.state_bytes,
    )
