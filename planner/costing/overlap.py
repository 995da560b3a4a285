"""DDP's gradient all-reduce overlapped with the backward pass, as DDP runs it.

DDP (``executors.parallel.data_parallel``: a one-stage plan with every parameter replicated) all-reduces its
gradients in buckets while backward is still running: a bucket is launched as soon as every gradient in
it is ready, and buckets run one after another on the communication stream. Under gradient
accumulation (``no_sync`` on all but the last microbatch) this happens during the last microbatch's
backward only. With the backward pass walked in reverse graph order (:func:`grad_ready_s`):

* gradient ``g`` is ready at ``r_g`` = the backward seconds up to and including its last reader in
  reverse order (its first reader in forward order);
* gradients are bucketed in the order they become ready (DDP rebuilds its buckets in that order after
  the first step), 1 MiB first then 25 MiB (:func:`cost_models.communication.ddp_buckets`); bucket
  ``k`` is ready at ``R_k`` = the ready time of its last gradient and takes ``c_k`` = one all-reduce
  of its bytes (:func:`ddp_segments`);
* the communication stream finishes bucket ``k`` at ``E_k = max(R_k, E_{k−1}) + c_k``; what the step
  waits for beyond the backward pass ``T_b`` is ``max(0, E_last − T_b)`` (:func:`exposed_sync_s`).

The estimate of a one-stage plan run as DDP (:func:`planner.costing.ddp.ddp_step`) charges that exposed part;
the simulator (:mod:`planner.costing.lowering`) splits the last backward at the same ready times and
runs the buckets as tasks on a communication resource, so the two agree. A data-parallel plan at a ZeRO level
runs FSDP instead, priced by :mod:`planner.costing.zero`.

Sharded (DTensor) stages, in a pipeline or alone, reduce their partial-sum gradients the same way
(:mod:`executors.parallel.grad_sync`): :func:`stage_grad_entries` lists each parameter the stage's records sync
(its first reader's ``sync`` collectives: the mesh axes it is summed over, and its local shard's shape),
in gradient-ready order (:func:`grad_ready_order`: the later its first reader, the earlier it is ready);
:func:`stage_buckets` packs them with DDP's caps, one bucket per set of mesh axes (one process group),
never splitting a tensor (:func:`pack_buckets`, the executor's packing too); a bucket summed over one
axis goes out as soon as its gradients are ready during the last microbatch's backward, one summed over
several axes after the backward (one axis after the other); a runtime that keeps one gradient buffer and syncs it
after the backward (:func:`runtime_buckets`: Megatron-LM's local DDP) has one bucket per process group, ready at the
backward's end. Bucket ``k`` then costs
``c_k = Σ_axes all_reduce(bytes_k, axis)``, or what a lossy choice makes of it
(:mod:`planner.costing.compression`), and :func:`stage_segments` cuts the stage's last backward at the
buckets' ready times. :func:`after_backward_s` is what the step waits past the backward of the last
microbatch: with the backward ``T_b`` (the recomputed forward, when the stage recomputes, runs first, so it
delays every bucket) and compression compute ``z_k`` on the device when bucket ``k`` goes out,
``max(T_b + Σ z_k, E_last) − T_b``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from cost_models.cluster import Link
from cost_models.communication import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, all_reduce_s
from cost_models.memory import optimizer_bytes
from planner.costing.runtime_profiles import AUTOPLAN, RuntimeProfile
from planner.ir.graph import OpGraph, ValueKind
from planner.plan import Stage
from planner.sharding.specs import ShardingSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSegment:
    """``backward_s`` more seconds of backward, after which a bucket taking ``all_reduce_s`` is ready."""

    backward_s: float
    all_reduce_s: float
    compress_s: float = 0.0  # device compute of a lossy hook when the bucket goes out (compression)
    hidden_s: float = 0.0  # communication of the bucket that later steps hide (DGA), besides all_reduce_s


@dataclass(frozen=True, kw_only=True, slots=True)
class GradEntry:
    """One parameter's gradient as its stage syncs it: this device's shard and the mesh axes it is summed over."""

    name: str
    shape: tuple[int, ...]  # the local shard's shape
    axes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadyBucket:
    """A bucket of gradients and the seconds into the last backward at which it goes out."""

    entries: tuple[GradEntry, ...]
    ready_s: float

    @property
    def axes(self) -> tuple[int, ...]:
        return self.entries[0].axes

    @property
    def numel(self) -> int:
        return sum(entry.numel for entry in self.entries)


def grad_ready_s(graph: OpGraph, bwd_s: Mapping[str, float]) -> dict[str, float]:
    """Parameter name -> seconds into the backward pass at which its gradient is complete."""
    ready: dict[str, float] = {}
    elapsed = 0.0
    for node in reversed(graph.nodes):
        elapsed += bwd_s.get(node.name, 0.0)
        for value in node.inputs:
            if graph.value_kind(value) == ValueKind.PARAM:
                ready[value] = elapsed
    return ready


def grad_ready_order(graph: OpGraph, nodes: Sequence[str] | None = None) -> list[str]:
    """The parameters read by ``nodes`` (default: all) in the order backward completes their gradients: the
    later a parameter's first reader, the earlier it is ready; parameters of one first reader in its input order."""
    names = [node.name for node in graph.nodes] if nodes is None else list(nodes)
    first: dict[str, tuple[int, int]] = {}
    for position, name in enumerate(names):
        for slot, value in enumerate(graph.node(name).inputs):
            if graph.value_kind(value) == ValueKind.PARAM:
                first.setdefault(value, (position, slot))
    return sorted(first, key=lambda value: (-first[value][0], first[value][1]))


def pack_buckets(
    sizes: Sequence[float],
    keys: Sequence[Hashable],
    *,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Positions of the gradients in each bucket, ``sizes`` in gradient-ready order: each key (a process group)
    fills its own buckets as DDP does (:func:`cost_models.communication.ddp_buckets`: a bucket closes once it
    holds its cap, 1 MiB for the key's first, then 25 MiB; a gradient is never split). Buckets come in the order
    they can go out: by their last gradient."""
    open_: dict[Hashable, list[int]] = {}
    filled: dict[Hashable, float] = {}
    caps: dict[Hashable, float] = {}
    buckets: list[list[int]] = []
    for position, (size, key) in enumerate(zip(sizes, keys, strict=True)):
        open_.setdefault(key, []).append(position)
        filled[key] = filled.get(key, 0.0) + size
        if filled[key] >= caps.setdefault(key, first_bucket_bytes):
            buckets.append(open_.pop(key))
            filled[key], caps[key] = 0.0, bucket_bytes
    buckets.extend(members for members in open_.values() if members)
    return sorted(buckets, key=lambda members: members[-1])


def stage_grad_entries(stage: Stage, graph: OpGraph) -> list[GradEntry]:
    """The gradients ``stage`` syncs, in gradient-ready order: each parameter its records sum over some mesh
    axes (its first reader's ``sync`` collectives), with its local shard's shape."""
    entries: dict[str, GradEntry] = {}
    for name in stage.nodes:
        node, record = graph.node(name), stage.strategies[name]
        for position, (value, meta) in enumerate(zip(node.inputs, node.input_metas, strict=True)):
            if graph.value_kind(value) != ValueKind.PARAM or value in entries:
                continue
            spec = record.input_specs[position]
            axes = tuple(c.axis for c in record.collectives if c.phase == "sync" and c.operand == position)
            shards = ShardingSpec(tuple(spec)).shards_per_dim(stage.mesh_shape) if spec is not None else {}
            shape = tuple(size // shards.get(dim, 1) for dim, size in enumerate(meta.shape))
            entries[value] = GradEntry(name=value, shape=shape, axes=axes)
    return [entries[name] for name in grad_ready_order(graph, stage.nodes) if entries[name].axes]


def stage_buckets(
    entries: Sequence[GradEntry],
    *,
    grad_itemsize: float,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[tuple[GradEntry, ...]]:
    """``entries`` (gradient-ready order) packed into buckets, one process group per bucket: those summed over
    one mesh axis in the order they go out, then those summed over several (after the backward). The caps are
    DDP's unless given (infinite: one buffer per process group)."""
    sizes, keys = [e.numel * grad_itemsize for e in entries], [e.axes for e in entries]
    buckets = [
        tuple(entries[k] for k in members)
        for members in pack_buckets(sizes, keys, bucket_bytes=bucket_bytes, first_bucket_bytes=first_bucket_bytes)
    ]
    return [b for b in buckets if len(b[0].axes) == 1] + [b for b in buckets if len(b[0].axes) > 1]


def ready_buckets(
    graph: OpGraph, nodes: Sequence[str], buckets: Sequence[tuple[GradEntry, ...]], bwd_s: Mapping[str, float]
) -> tuple[list[ReadyBucket], float]:
    """Each bucket with the time its last gradient is ready (a several-axes bucket: the backward's end), and
    the backward's seconds, walking ``nodes`` backwards with ``bwd_s``."""
    ready: dict[str, float] = {}
    elapsed = 0.0
    for name in reversed(nodes):
        elapsed += bwd_s.get(name, 0.0)
        for value in graph.node(name).inputs:
            ready[value] = elapsed
    return [
        ReadyBucket(entries=bucket, ready_s=elapsed if len(bucket[0].axes) > 1 else max(ready[e.name] for e in bucket))
        for bucket in buckets
    ], elapsed


def runtime_buckets(
    graph: OpGraph,
    nodes: Sequence[str],
    entries: Sequence[GradEntry],
    bwd_s: Mapping[str, float],
    *,
    grad_itemsize: float,
    runtime: RuntimeProfile,
) -> tuple[list[ReadyBucket], float]:
    """``entries`` packed and timed as ``runtime`` syncs them (:mod:`planner.costing.runtime_profiles`): DDP's
    buckets as they become ready (:func:`stage_buckets`, :func:`ready_buckets`), or one buffer per process group
    (``one_grad_buffer``), every bucket at the backward's end under ``grad_sync_after_backward``; and the backward's
    seconds."""
    caps = {"bucket_bytes": math.inf, "first_bucket_bytes": math.inf} if runtime.one_grad_buffer else {}
    ready, total = ready_buckets(graph, nodes, stage_buckets(entries, grad_itemsize=grad_itemsize, **caps), bwd_s)
    if runtime.grad_sync_after_backward:
        ready = [ReadyBucket(entries=bucket.entries, ready_s=total) for bucket in ready]
    return ready, total


def cut_backward(
    buckets: Sequence[ReadyBucket], backward_s: float, price: Callable[[ReadyBucket], tuple[float, float]]
) -> list[SyncSegment]:
    """The backward cut where each bucket goes out, ``price(bucket) = (communication s, compression s)``; a
    final segment with no bucket ends it."""
    segments, done = [], 0.0
    for bucket in buckets:
        comm_s, compress_s = price(bucket)
        segments.append(SyncSegment(backward_s=bucket.ready_s - done, all_reduce_s=comm_s, compress_s=compress_s))
        done = bucket.ready_s
    segments.append(SyncSegment(backward_s=max(0.0, backward_s - done), all_reduce_s=0.0))
    return segments


def ddp_entries(graph: OpGraph) -> list[GradEntry]:
    """Every parameter a node reads, whole, summed over the one axis of DDP's group, in gradient-ready order."""
    return [
        GradEntry(name=name, shape=tuple(graph.value(name).meta.shape), axes=(0,)) for name in grad_ready_order(graph)
    ]


def ddp_segments(
    graph: OpGraph,
    bwd_s: Mapping[str, float],
    *,
    optimizer: str,
    num_devices: int,
    link: Link,
    runtime: RuntimeProfile = AUTOPLAN,
) -> list[SyncSegment]:
    """The last backward cut where DDP's buckets become ready; a final segment with no bucket ends it. Under a
    runtime with one gradient buffer synced after the backward (Megatron-LM's local DDP), one bucket at its end."""
    grad_bytes = optimizer_bytes(optimizer).grads
    ready, total = runtime_buckets(
        graph, [node.name for node in graph.nodes], ddp_entries(graph), bwd_s, grad_itemsize=grad_bytes, runtime=runtime
    )
    return cut_backward(
        ready, total, lambda bucket: (all_reduce_s(bucket.numel * grad_bytes, num_devices=num_devices, link=link), 0.0)
    )


def exposed_sync_s(segments: Sequence[SyncSegment]) -> float:
    """Seconds the step waits for the last bucket after the backward pass ends (compression compute included)."""
    return after_backward_s(segments, backward_s=math.fsum(segment.backward_s for segment in segments))


def after_backward_s(segments: Sequence[SyncSegment], *, backward_s: float) -> float:
    """What the step waits past a last backward of ``backward_s`` (module docstring): the part of it the
    segments do not cover runs first."""
    backward = max(0.0, backward_s - math.fsum(segment.backward_s for segment in segments))
    comm_end = 0.0
    for segment in segments:
        backward += segment.backward_s + segment.compress_s
        if segment.all_reduce_s > 0:
            comm_end = max(comm_end, backward) + segment.all_reduce_s
    return max(backward, comm_end) - backward_s
