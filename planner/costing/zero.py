"""ZeRO over the data-parallel axes: what each level communicates, when, and what the step waits for.

Levels (Rajbhandari et al. 2020, "ZeRO"; bytes per level in :func:`cost_models.memory.zero_shards`):
0 keeps everything on every replica; 1 shards the optimizer state over the ``d`` replicas; 2 the
gradients too; 3 the parameters too. How the executors run them, and what is charged:

* **a sharded (DTensor) stage, level 1** (:class:`executors.parallel.stages.ZeroOptimizerShards`; a pipeline's or a
  tensor-parallel stage, Megatron's distributed optimizer): the gradients are reduced as at level 0
  (the stage's buckets, :mod:`planner.costing.overlap`), each rank updates only its ``1/d`` of every
  parameter and its optimizer state, and the updated parameter is all-gathered — torch's
  ``ZeroRedundancyOptimizer`` scheme. Per parameter and step: ``all_gather(weight bytes)`` over each sync
  axis, and the optimizer update of ``1/d`` of the parameters (:func:`param_terms`).
* **a data-parallel plan (one stage, every parameter replicated), levels 1–3**: FSDP2 ``fully_shard`` on
  every layer group (:func:`planner.ir.layers.segments`; parameters read by several groups, tied
  embeddings, on the root), reshard after forward at level 3 only. Level 1 accumulates unsharded gradients
  over the microbatches and reduce-scatters them in the last backward; level 2 reduce-scatters in every
  backward; levels 1 and 2 all-gather the parameters before the first forward of a step and keep them to
  the step's end; level 3 all-gathers each group before its forward and again before its backward. Per
  parameter the additive shares the intra-op problem adds up (:func:`param_terms`, latency shared by
  a group as :func:`cost_models.communication.bucketed_all_reduce_s` shares it):

      level 1: step  rs(g) + ag(w)               level 2: step ag(w),  each microbatch rs(g)
      level 3: each microbatch rs(g) + 2·ag(w)   (g, w: the parameter's gradient and weight bytes)

  and the exact price of the plan (:func:`fsdp_timeline`), the estimate's and the simulator's alike: one
  communication stream, collectives in issue order; FSDP2 prefetches one group ahead (the all-gather of
  group ``k+1`` is issued when group ``k``'s forward starts, of group ``k−1`` when group ``k``'s backward
  starts); a group computes once its parameters are there; a reduce-scatter is issued when its group's
  backward ends. What a microbatch's forward (backward) adds to its compute is the wait for gathers, and
  what the step adds after the last backward is the stream's remainder. Level 3 holds at most two groups
  unsharded at once (the one computing and the one prefetched): :func:`gathered_bytes`.

Under CPU offload (``Stage.offload``) each gather starts with its shard's copy from the host and each reduce-scatter
ends with its shard's copy to the host, on the same stream (:func:`fsdp_groups`); the shards' memory and the
optimizer on the CPU: :mod:`planner.costing.offload`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from cost_models.communication import DDP_BUCKET_BYTES, all_gather_s, reduce_scatter_s
from cost_models.memory import optimizer_bytes
from planner.costing.offload import host_copy_s, offloaded_shards, offloads_memory
from planner.costing.setup import CostSetup
from planner.costing.stage_memory import StageMemory
from planner.ir.graph import OpGraph, ValueKind
from planner.ir.layers import segments
from planner.plan import Stage
from planner.sharding.specs import StageMesh

FSDP_GATHER_COPIES = 2  # a gathered group: FSDP2's all-gather buffer and the unsharded parameters copied out of it


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroTerms:
    step_s: float = 0.0  # once per step: the all-gather of updated parameters (and level 1's reduce-scatter)
    per_microbatch_s: float = 0.0  # every microbatch: FSDP's reduce-scatter (levels 2, 3) and gathers (3)


def param_terms(
    level: int, *, local_numel: float, setup: CostSetup, mesh: StageMesh, axes: Sequence[int], plain: bool
) -> ZeroTerms:
    """One parameter's ZeRO communication beyond level 0 (module docstring); ``plain``: the stage runs on plain
    tensors (a data-parallel plan, FSDP), else a sharded stage (level 1: the all-gather only, its gradient
    reduced as at level 0)."""
    if level == 0 or not axes:
        return ZeroTerms()
    per = optimizer_bytes(setup.optimizer)
    weights, grads = local_numel * per.weights, local_numel * per.grads
    if plain:
        link, n = setup.cluster.link_between(mesh.devices), len(mesh.devices)

        def shared(seconds: float, num_bytes: float) -> float:  # one latency per group, shared like DDP's buckets
            latency = (n - 1) * link.latency_s
            return seconds - latency + min(1.0, num_bytes / DDP_BUCKET_BYTES) * latency if seconds else 0.0

        gather = shared(all_gather_s(weights, num_devices=n, link=link), weights)
        scatter = shared(reduce_scatter_s(grads, num_devices=n, link=link), grads)
    else:  # one collective per parameter and axis (levels 2 and 3 price a data-parallel layer for the search)
        gather = math.fsum(mesh.all_gather_s(weights, axis) for axis in axes)
        scatter = math.fsum(mesh.reduce_scatter_s(grads, axis) for axis in axes)
    if level == 1:
        return ZeroTerms(step_s=scatter + gather if plain else gather)
    if level == 2:
        return ZeroTerms(step_s=gather, per_microbatch_s=scatter)
    return ZeroTerms(per_microbatch_s=scatter + 2 * gather)


def runs_as_fsdp(stages: Sequence[Stage]) -> bool:
    """A data-parallel plan (one stage on several devices, every parameter replicated) at ZeRO level ≥ 1."""
    return len(stages) == 1 and stages[0].is_pure_data_parallel and stages[0].zero >= 1


@dataclass(frozen=True, kw_only=True, slots=True)
class FsdpGroup:
    """One ``fully_shard`` group: its compute per microbatch and its collectives."""

    forward_s: float
    backward_s: float
    gather_s: float  # all-gather of its parameters
    scatter_s: float  # reduce-scatter of its gradients
    weight_bytes: float = 0.0  # its parameters unsharded


def fsdp_groups(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, forward_s: Mapping[str, float], backward_s: Mapping[str, float]
) -> list[FsdpGroup]:
    """The stage's FSDP groups in forward order (``graph`` at the microbatch size): the root first (parameters
    read by several groups), then one per layer group; ``forward_s``/``backward_s``: each node's seconds."""
    runs, readers = _param_readers(stage, graph)
    numel = {param.name: param.meta.numel for param in graph.params}
    owned: list[float] = [0.0] * (len(runs) + 1)  # index 0: the root
    for name, groups in readers.items():
        owned[0 if len(groups) > 1 else next(iter(groups)) + 1] += numel[name]
    per, link, n = optimizer_bytes(setup.optimizer), setup.cluster.link_between(stage.devices), len(stage.devices)
    result = []
    for index, params in enumerate(owned):
        run = runs[index - 1] if index else []
        weights, grads = params * per.weights, params * per.grads
        # CPU offload: the shard's copy in before its all-gather, out after its reduce-scatter (planner.costing.offload)
        copy_in, copy_out = (
            (host_copy_s(weights / n, setup), host_copy_s(grads / n, setup)) if stage.offload else (0, 0)
        )
        result.append(
            FsdpGroup(
                forward_s=math.fsum(forward_s[name] for name in run),
                backward_s=math.fsum(backward_s[name] for name in run),
                gather_s=all_gather_s(weights, num_devices=n, link=link) + copy_in,
                scatter_s=reduce_scatter_s(grads, num_devices=n, link=link) + copy_out,
                weight_bytes=weights,
            )
        )
    return result


@dataclass(frozen=True, kw_only=True)
class FsdpTimeline:
    forward_wait_s: tuple[float, ...]  # per microbatch: seconds its forward waits for all-gathers
    backward_wait_s: tuple[float, ...]  # per microbatch: seconds its backward waits for all-gathers
    tail_s: float  # after the last backward: the communication stream's remainder (the last reduce-scatters)
    comm_s: float  # every collective of the step


def fsdp_timeline(groups: Sequence[FsdpGroup], *, level: int, num_microbatches: int) -> FsdpTimeline:
    """The step's communication against its compute under FSDP at ``level`` (module docstring)."""
    assert level in (1, 2, 3), level
    comm = clock = total = 0.0
    forward_waits, backward_waits = [], []
    count = len(groups)

    def gather(k: int, at: float, ready: list[float], *, enabled: bool) -> None:
        """Group ``k``'s all-gather, issued at ``at`` behind what the stream already holds."""
        nonlocal comm, total
        if enabled and 0 <= k < count and groups[k].gather_s > 0:
            comm = max(comm, at) + groups[k].gather_s
            total += groups[k].gather_s
            ready[k] = comm

    for i in range(num_microbatches):
        gather_forward, gather_backward = level == 3 or i == 0, level == 3
        scatter = level >= 2 or i == num_microbatches - 1
        ready, start = [clock] * count, clock
        gather(0, clock, ready, enabled=gather_forward)
        for k in range(count):
            begin = max(clock, ready[k])
            gather(k + 1, begin, ready, enabled=gather_forward)
            clock = begin + groups[k].forward_s
        forward_waits.append(clock - start - math.fsum(g.forward_s for g in groups))
        ready, start = [clock] * count, clock
        gather(count - 1, clock, ready, enabled=gather_backward)
        for k in reversed(range(count)):
            begin = max(clock, ready[k])
            gather(k - 1, begin, ready, enabled=gather_backward)
            clock = begin + groups[k].backward_s
            if scatter and groups[k].scatter_s > 0:
                comm = max(comm, clock) + groups[k].scatter_s
                total += groups[k].scatter_s
        backward_waits.append(clock - start - math.fsum(g.backward_s for g in groups))
    return FsdpTimeline(
        forward_wait_s=tuple(forward_waits),
        backward_wait_s=tuple(backward_waits),
        tail_s=max(0.0, comm - clock),
        comm_s=total,
    )


def gathered_bytes(groups: Sequence[FsdpGroup], *, level: int) -> float:
    """Unsharded parameter bytes FSDP holds beyond the shards at level 3: the two largest consecutive groups
    (one computing, the next prefetched), and the root's, gathered for the whole forward and backward."""
    if level < 3 or not groups:
        return 0.0
    pairs = [groups[k].weight_bytes + groups[k + 1].weight_bytes for k in range(1, len(groups) - 1)]
    return groups[0].weight_bytes + max(pairs, default=groups[-1].weight_bytes if len(groups) > 1 else 0.0)


@dataclass(frozen=True, kw_only=True)
class FsdpPrice:
    """A data-parallel plan under FSDP, per microbatch on average and per step (the estimate's and the simulator's)."""

    forward_wait_s: float  # a microbatch's forward waits this long for all-gathers, on average
    backward_wait_s: float
    tail_s: float  # the step waits this long after the last backward (the last reduce-scatters)
    gathered_bytes: float  # unsharded parameters held beyond the shards (level 3)
    comm_s: float  # every collective of the step


def fsdp_price(
    stage: Stage, graph: OpGraph, setup: CostSetup, *, work: Mapping[str, object], num_microbatches: int
) -> FsdpPrice:
    """:func:`fsdp_timeline` of a data-parallel ``stage`` from its nodes' work (``NodeWork``: ``fwd_s``, and
    ``bwd_s`` + ``recompute_s``, the recomputed forward running in the backward)."""
    forward = {name: w.fwd_s for name, w in work.items()}  # type: ignore[attr-defined]
    backward = {name: w.bwd_s + w.recompute_s for name, w in work.items()}  # type: ignore[attr-defined]
    groups = fsdp_groups(stage, graph, setup, forward_s=forward, backward_s=backward)
    timeline = fsdp_timeline(groups, level=stage.zero, num_microbatches=num_microbatches)
    m = num_microbatches
    return FsdpPrice(
        forward_wait_s=math.fsum(timeline.forward_wait_s) / m,
        backward_wait_s=math.fsum(timeline.backward_wait_s) / m,
        tail_s=timeline.tail_s,
        gathered_bytes=gathered_bytes(groups, level=stage.zero),
        comm_s=timeline.comm_s,
    )


def fsdp_memory(stage: Stage, graph: OpGraph, setup: CostSetup, *, num_microbatches: int = 1) -> StageMemory:
    """A data-parallel ``stage`` under FSDP at its ZeRO level (``graph`` at the microbatch size): one replica's
    memory with its state sharded as the level shards it (:func:`cost_models.memory.zero_shards`; the shards on the
    host under CPU offload, :func:`planner.costing.offload.offloaded_shards`), what FSDP holds
    while each node runs (:func:`fsdp_node_bytes`) and for the whole step (:func:`fsdp_held_bytes`)."""
    from planner.costing.estimate import replica_memory

    weights, grads, state = offloaded_shards(stage.zero, len(stage.devices), offload=offloads_memory(stage, setup))
    memory = replica_memory(
        graph,
        setup,
        num_devices=len(stage.devices),
        weight_shards=weights,
        grad_shards=grads,
        state_shards=state,
        grads_in_tape=num_microbatches == 1,
        extra=fsdp_node_bytes(stage, graph, setup),
    )
    return replace(memory, held_bytes=memory.held_bytes + fsdp_held_bytes(stage, graph, setup))


def fsdp_held_bytes(stage: Stage, graph: OpGraph, setup: CostSetup) -> float:
    """What FSDP holds beyond the shards for a whole step at levels 1 and 2: every parameter unsharded (gathered
    at the step's first forward, kept to its end). Level 3 holds a group's only while it runs
    (:func:`fsdp_node_bytes`)."""
    if stage.zero not in (1, 2):
        return 0.0
    idle = dict.fromkeys(stage.nodes, 0.0)
    return math.fsum(g.weight_bytes for g in fsdp_groups(stage, graph, setup, forward_s=idle, backward_s=idle))


def fsdp_node_bytes(stage: Stage, graph: OpGraph, setup: CostSetup) -> dict[str, tuple[float, float]]:
    """Node -> (bytes it holds while it runs, forward and backward; bytes while its backward runs) under FSDP.
    At level 3: its group's parameters twice — FSDP2 all-gathers a group into one flat buffer, copies it out into
    the unsharded parameters and keeps the buffer until the next group's all-gather (``FSDP_GATHER_COPIES``) —
    the neighbour group's prefetched (the larger of the next, prefetched in forward, and the previous, in
    backward), and the root group's while a node reading them runs; the group's unsharded gradients replace its
    unsharded parameters (FSDP2 reshards a group after its backward, before it reduce-scatters the gradients).
    At level 2 every parameter stays gathered (:func:`fsdp_held_bytes`) and the group's unsharded gradients are
    held at the backward of its first node (the last of the group to run backward, when its reduce-scatter
    starts). Level 1 accumulates whole gradients (the timeline charges them)."""
    if stage.zero < 2:
        return {}
    idle = dict.fromkeys(stage.nodes, 0.0)
    groups = fsdp_groups(stage, graph, setup, forward_s=idle, backward_s=idle)
    runs, shared = _group_runs(stage, graph)
    per = optimizer_bytes(setup.optimizer)
    to_grads = per.grads / per.weights if per.weights else 0.0
    level3 = stage.zero >= 3
    found: dict[str, tuple[float, float]] = {}
    root_readers = [name for run in runs for name in run if shared & set(graph.node(name).inputs)]
    for index, run in enumerate(runs):
        own = groups[index + 1].weight_bytes
        neighbours = [groups[k].weight_bytes for k in (index, index + 2) if 1 <= k < len(groups)]
        held = FSDP_GATHER_COPIES * own + max(neighbours, default=0.0) if level3 else 0.0
        for name in run:
            found[name] = (held, 0.0)
        found[run[0]] = (held, 0.0 if level3 else own * to_grads)
    root = groups[0].weight_bytes
    for name in root_readers:
        held, backward = found.get(name, (0.0, 0.0))
        found[name] = (held + (FSDP_GATHER_COPIES * root if level3 else 0.0), backward)
    if root_readers and not level3:
        held, backward = found[root_readers[0]]
        found[root_readers[0]] = (held, backward + root * to_grads)
    return found


def _group_runs(stage: Stage, graph: OpGraph) -> tuple[list[list[str]], set[str]]:
    """The layer groups' node runs (:func:`fsdp_groups`' order, the root aside) and the parameters several read."""
    runs, readers = _param_readers(stage, graph)
    return runs, {name for name, found in readers.items() if len(found) > 1}


def _param_readers(stage: Stage, graph: OpGraph) -> tuple[list[list[str]], dict[str, set[int]]]:
    """The layer groups' node runs in forward order and, per parameter, the runs that read it."""
    chosen = set(stage.nodes)
    runs = [[node.name for node in nodes if node.name in chosen] for _, nodes in segments(graph)]
    runs = [run for run in runs if run]
    readers: dict[str, set[int]] = {}
    for index, run in enumerate(runs):
        for name in run:
            for value in graph.node(name).inputs:
                if graph.value_kind(value) == ValueKind.PARAM:
                    readers.setdefault(value, set()).add(index)
    return runs, readers


def gathered_param_bytes(stage: Stage, graph: OpGraph, setup: CostSetup) -> float:
    """:func:`gathered_bytes` of a data-parallel ``stage`` at its ZeRO level (0 below level 3)."""
    if stage.zero < 3:
        return 0.0
    idle = dict.fromkeys(stage.nodes, 0.0)
    return gathered_bytes(fsdp_groups(stage, graph, setup, forward_s=idle, backward_s=idle), level=stage.zero)
