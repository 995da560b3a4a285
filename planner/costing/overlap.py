"""DDP's gradient all-reduce overlapped with the backward pass, as DDP runs it.

DDP (``executors.data_parallel``: a one-stage plan with every parameter replicated) all-reduces its
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

The estimate (:func:`planner.costing.estimate.data_parallel_estimate`, and
:func:`planner.inter.pricing.price_stages` for a one-stage plan run as DDP) charges that exposed part;
the simulator (:mod:`planner.costing.lowering`) splits the last backward at the same ready times and
runs the buckets as tasks on a communication resource, so the two agree. A stage under ``zero`` runs
FSDP with one ``fully_shard`` over the whole module: its reduce-scatter starts after the whole backward,
no overlap, and sharded (DTensor) stages redistribute gradients after backward too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cost_models.cluster import Link
from cost_models.communication import all_reduce_s, ddp_buckets
from cost_models.memory import optimizer_bytes
from planner.ir.graph import OpGraph, ValueKind


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSegment:
    """``backward_s`` more seconds of backward, after which a bucket taking ``all_reduce_s`` is ready."""

    backward_s: float
    all_reduce_s: float


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


def ddp_segments(
    graph: OpGraph, bwd_s: Mapping[str, float], *, optimizer: str, num_devices: int, link: Link
) -> list[SyncSegment]:
    """The last backward cut where DDP's buckets become ready; a final segment with no bucket ends it."""
    ready = grad_ready_s(graph, bwd_s)
    order = sorted(ready, key=lambda name: ready[name])
    grad_bytes = optimizer_bytes(optimizer).grads
    sizes = [graph.value(name).meta.numel * grad_bytes for name in order]
    segments, done, start = [], 0.0, 0
    for bucket in ddp_buckets(sizes):
        filled, end = 0.0, start
        while filled < bucket - 1e-9:  # the gradients of this bucket, in ready order
            filled, end = filled + sizes[end], end + 1
        at = ready[order[end - 1]]
        segments.append(SyncSegment(backward_s=at - done,
                                    all_reduce_s=all_reduce_s(bucket, num_devices=num_devices, link=link)))  # fmt: skip
        done, start = at, end
    total = sum(bwd_s.get(node.name, 0.0) for node in graph.nodes)
    segments.append(SyncSegment(backward_s=max(0.0, total - done), all_reduce_s=0.0))
    return segments


def exposed_sync_s(segments: list[SyncSegment]) -> float:
    """Seconds the step waits for the last bucket after the backward pass ends."""
    backward = comm_end = 0.0
    for segment in segments:
        backward += segment.backward_s
        if segment.all_reduce_s > 0:
            comm_end = max(comm_end, backward) + segment.all_reduce_s
    return max(0.0, comm_end - backward)
