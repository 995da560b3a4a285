"""How a value reaches a node of a tensor-parallel stage, and how its gradient goes back.

A record's specs as DTensor placements (:func:`to_placements`); an activation's gradient pinned to the placements
the cost model charges it at (:class:`GradAsPlanned`: Megatron's ``f`` all-reduce at the edge, not wherever
DTensor would resolve a pending partial sum); sequence parallelism's gathered (``R*``) tensors, whose readers
hand their gradients back partial for the producer to reduce-scatter once (:func:`node_edges`,
:class:`SliceKeepingPartialGradient`); the gradient placements of an operator run on local shards
(:func:`local_grad_placements`); and a gradient whose local shard is laid out otherwise than its DTensor claims
made contiguous before its node's backward reads it (:func:`contiguous_local_grad`).
:class:`executors.parallel.tensor_parallel.StageSharding` applies them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.nn import functional as F

from planner.ir.graph import OpNode
from planner.plan import GATHERED, NodeSharding, parse_placement


def to_placements(spec: Sequence[str]) -> tuple[Placement, ...]:
    """``("S(1)", "R")`` -> ``(Shard(1), Replicate())``."""
    result: list[Placement] = []
    for text in spec:
        kind, dim = parse_placement(text)  # R and R* (gathered) are both replicated in forward
        result.append(Shard(dim) if kind == "S" else Partial() if kind == "P" else Replicate())
    return tuple(result)


def local_grad_placements(tensor: DTensor, output: tuple[Placement, ...]) -> list[Placement]:
    """The placements of the gradient of ``tensor.to_local()`` when the operator runs on local shards with
    its output in ``output``: a shard's gradient is that shard of the gradient, but a whole input read on
    an axis the output splits (attention's bias against a batch split, a linear's weight against split
    rows) gets from each rank only its share of the gradient there — a partial sum, reduced later."""
    return [
        Partial() if placement.is_replicate() and isinstance(out, Shard) else placement
        for placement, out in zip(tensor.placements, output, strict=True)
    ]


def contiguous_local_grad(grad: Any) -> Any:
    """A gradient DTensor whose local shard is not contiguous, as a contiguous copy (None: keep ``grad``).

    A redistribution's backward (an all-gather along a later dim, say) can hand back a DTensor whose
    global strides say contiguous while its local shard is laid out otherwise; the backward of a ``view``
    (``reshape`` of the gradient), which DTensor runs as a local ``view`` when the global strides allow one,
    then fails with "view size is not compatible with input tensor's size and stride". Registered as a hook
    on every node output of a tensor-parallel stage, so each node's backward reads a gradient laid out as
    it claims (a copy only where the local shard is not contiguous)."""
    if not isinstance(grad, DTensor) or grad._local_tensor.is_contiguous():
        return None
    return DTensor.from_local(
        grad._local_tensor.contiguous(),
        grad.device_mesh,
        grad.placements,
        run_check=False,
        shape=grad.shape,
        stride=contiguous_stride(grad.shape),
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


class GradAsPlanned(torch.autograd.Function):
    """Identity forward; backward brings the gradient to the value's own placements (or ``placements``) right here.

    The cost model charges a column-split contraction's replicated input one gradient all-reduce at
    that input (Megatron's ``f``). DTensor would leave the partial gradient pending and resolve it
    wherever a later backward operator needs it, with other collectives; this pins it to the edge.
    Pinned to ``Partial`` it keeps a gradient partial (a gathered tensor's, reduce-scattered by its producer).
    """

    @staticmethod
    def forward(ctx: Any, tensor: DTensor, placements: tuple[Placement, ...] | None = None) -> DTensor:
        ctx.mesh, ctx.placements = tensor.device_mesh, placements or tuple(tensor.placements)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if not isinstance(grad, DTensor) or tuple(grad.placements) == ctx.placements:
            return grad, None
        pairs = list(zip(grad.placements, ctx.placements, strict=True))
        made_partial = [axis for axis, (now, wanted) in enumerate(pairs) if now.is_replicate() and wanted.is_partial()]
        if made_partial:  # DTensor will not redistribute to Partial: a replica is a partial sum kept on one rank
            keep = all(ctx.mesh.get_local_rank(axis) == 0 for axis in made_partial)
            local = grad.to_local() if keep else torch.zeros_like(grad.to_local())
            placements = [Partial() if axis in made_partial else now for axis, (now, _) in enumerate(pairs)]
            grad = DTensor.from_local(
                local, ctx.mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
        return grad.redistribute(ctx.mesh, ctx.placements), None


@dataclass(frozen=True)
class Edge:  # how an activation reaches a node where gathered (R*) tensors are involved (node_edges)
    source_pin: tuple[Placement, ...] | None = None  # at the producer's side: partial on its R* axes
    sliced: tuple[Placement, ...] | None = None  # R* axes read as shards: sliced with their gradient kept partial
    own_pin: tuple[Placement, ...] | None = None  # at the reader's side, instead of its record's input placements


def node_edges(node: OpNode, record: NodeSharding, strategies: Mapping[str, NodeSharding]) -> list[Edge]:
    """Per input of ``node``, how its gradient goes back where gathered (``R*``) tensors are involved, with the
    collectives :func:`planner.sharding.specs.reshard_s` prices: every reader of a gathered output hands back a
    partial gradient there (pinned on the producer's side), which the producer reduce-scatters once — a reader
    of a shard no other axis splits slices it locally and hands back its gradient shard as a partial sum
    (:class:`SliceKeepingPartialGradient`); a reader of an input ``R*`` keeps its gradient partial there when
    the producer gathered its output, and all-reduces it on the edge (pinned replicated) when it did not."""
    edges: list[Edge] = []
    for value, spec in zip(node.inputs, record.input_specs, strict=True):
        source = tuple(strategies[value].output_spec) if value in strategies else ()
        if spec is None or GATHERED not in (*source, *spec):
            edges.append(Edge())
            continue
        held, wanted = to_placements(source), to_placements(spec)
        gathered = [axis for axis, text in enumerate(source) if text == GATHERED]
        partial = tuple(Partial() if axis in gathered else placement for axis, placement in enumerate(held))
        own_pin = tuple(
            Partial() if text == GATHERED and axis in gathered else placement
            for axis, (text, placement) in enumerate(zip(spec, wanted, strict=True))
        )
        local = [axis for axis in gathered if spec[axis].startswith("S") and spec.count(spec[axis]) == 1]
        sliced = tuple(wanted[axis] if axis in local else placement for axis, placement in enumerate(held))
        edges.append(
            Edge(
                source_pin=partial if gathered else None,
                sliced=sliced if local else None,
                own_pin=own_pin if GATHERED in spec else None,
            )
        )
    return edges


class SliceKeepingPartialGradient(torch.autograd.Function):
    """A replicated tensor sliced into shards (no communication); backward, each rank's gradient shard goes
    back as a partial sum — the shard in place, zeros elsewhere — instead of being all-gathered: the producer
    of a gathered tensor reduce-scatters its readers' partial gradients anyway (sequence parallelism)."""

    @staticmethod
    def forward(ctx: Any, tensor: DTensor, placements: tuple[Placement, ...]) -> DTensor:
        ctx.mesh, ctx.source = tensor.device_mesh, tuple(tensor.placements)
        return tensor.redistribute(tensor.device_mesh, placements)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> Any:
        mesh, local, placements = ctx.mesh, grad.to_local(), list(grad.placements)
        for axis, (before, after) in enumerate(zip(ctx.source, grad.placements, strict=True)):
            if before.is_replicate() and isinstance(after, Shard):  # the shard in place, zeros elsewhere
                size, index = local.shape[after.dim], mesh.get_local_rank(axis)
                pads = [0, 0] * (local.ndim - 1 - after.dim)
                local = F.pad(local, [*pads, index * size, (mesh.size(axis) - 1 - index) * size])
                placements[axis] = Partial()
        whole = DTensor.from_local(local, mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride())
        return whole, None
