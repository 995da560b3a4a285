"""One plan stage on this rank: its segment of the graph, its mesh, DTensor parameters and module.

:func:`build_meshes` makes every stage's device mesh on every rank (DeviceMesh creates process
groups, a collective call). :func:`build_stage` returns the :class:`StagePart` of a stage this rank
belongs to: a :class:`~executors.graph_module.GraphModule` whose nodes run through
:class:`~executors.tensor_parallel.StageSharding`, wrapped so that it takes and returns whole
tensors (:class:`ShardedStageModule`) — what pipeline transfers and loss functions see.

A parameter read in several stages (tied embeddings) has a copy in each; :func:`sync_shared_grads`
sums their gradients over the world so every copy takes the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from executors.graph_module import GraphModule, Segment
from executors.tensor_parallel import SingleDeviceSharding, StageSharding, make_mesh
from planner.ir.graph import OpGraph
from planner.plan import Plan, Stage


def build_meshes(plan: Plan, *, device_type: str) -> list[DeviceMesh]:
    return [make_mesh(stage.devices, stage.mesh_shape, device_type=device_type) for stage in plan.stages]


class ShardedStageModule(nn.Module):
    """Whole tensors in, whole tensors out; DTensors inside; optionally the loss at the end."""

    def __init__(
        self, inner: GraphModule, sharding: StageSharding | SingleDeviceSharding, *,
        loss: Callable[[tuple[Any, ...], tuple[Any, ...]], torch.Tensor] | None = None,
        loss_inputs: tuple[int, ...] = (),
        wire_dtype: Callable[[torch.dtype], torch.dtype] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.inner = inner
        self.sharding = sharding
        self._loss = loss
        self._loss_inputs = loss_inputs  # positions of the graph inputs the loss reads among forward's args
        self._wire_dtype = wire_dtype  # the dtype a sent value travels in (bf16 under mixed precision)

    def forward(self, *values: Any) -> Any:
        outputs = self.inner(*(self.sharding.enter(v) for v in values))
        whole = tuple(self.sharding.leave(v) for v in outputs)
        if self._loss is None:  # sent to the next stage: point-to-point sends need contiguous tensors
            whole = tuple(self._to_wire(v).contiguous() if isinstance(v, torch.Tensor) else v for v in whole)
            return whole if len(whole) != 1 else whole[0]
        return self._loss(whole, tuple(values[i] for i in self._loss_inputs))

    def _to_wire(self, value: torch.Tensor) -> torch.Tensor:
        return value if self._wire_dtype is None else value.to(self._wire_dtype(value.dtype))


@dataclass(kw_only=True)
class StagePart:
    stage: Stage
    segment: Segment
    module: ShardedStageModule
    sharding: StageSharding | SingleDeviceSharding
    params: dict[str, nn.Parameter]  # fully qualified name -> this rank's (DTensor) parameter

    def sync_grads(self) -> None:
        self.sharding.sync_grads(list(self.params.values()))

    def full_grads(self, owned: set[str]) -> dict[str, torch.Tensor]:
        """Whole gradients of the parameters this stage owns (a collective over the stage's mesh)."""
        result = {}
        for name in sorted(owned & set(self.params)):
            grad = self.params[name].grad
            if grad is not None:
                result[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
        return result


def param_specs(stage: Stage, graph: OpGraph, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each parameter's placement on this stage: the plan's, or (for a parameter placed in another
    stage, a tied weight) the spec its first reader here reads it in."""
    specs = {name: tuple(stage.param_placements[name]) for name in names if name in stage.param_placements}
    for node_name in stage.nodes:
        for value, spec in zip(graph.node(node_name).inputs, stage.strategies[node_name].input_specs, strict=True):
            if spec is not None:
                specs.setdefault(value, tuple(spec))
    return {name: specs.get(name, ("R",) * len(stage.mesh_shape)) for name in names}


def build_stage(
    *, stage: Stage, graph: OpGraph, segment: Segment, mesh: DeviceMesh, model_params: Mapping[str, Any],
    model_buffers: Mapping[str, Any], device: str,
    loss: Callable[[tuple[Any, ...], tuple[Any, ...]], torch.Tensor] | None = None, loss_inputs: tuple[int, ...] = (),
    wire_dtype: Callable[[torch.dtype], torch.dtype] | None = None,
) -> StagePart:  # fmt: skip
    """The part of ``stage`` this rank runs, every node as the plan's record of it says."""
    sharding: StageSharding | SingleDeviceSharding
    if len(stage.devices) == 1:
        sharding = SingleDeviceSharding(device=device)
    else:
        sharding = StageSharding(mesh=mesh, strategies=stage.strategies, graph=graph, device=device)
    specs = param_specs(stage, graph, segment.params)
    params = sharding.distribute_params({name: model_params[name] for name in segment.params}, specs)
    buffers = sharding.distribute_buffers({name: model_buffers[name] for name in segment.buffers})
    inner = GraphModule(graph, segment, params=params, buffers=buffers, call_node=sharding.call_node, device=device)
    module = ShardedStageModule(inner, sharding, loss=loss, loss_inputs=loss_inputs, wire_dtype=wire_dtype)
    return StagePart(stage=stage, segment=segment, module=module, sharding=sharding,
                     params=dict(inner.named_graph_parameters()))  # fmt: skip


def sync_shared_grads(part: StagePart | None, shared: Sequence[str], *, is_reporter: bool, device: str,
                      metas: Mapping[str, torch.Tensor]) -> None:  # fmt: skip
    """Sum each shared parameter's gradient over the stages that read it (every rank takes part)."""
    for name in shared:
        param = part.params.get(name) if part is not None else None
        whole = torch.zeros_like(metas[name], device=device)
        if param is not None and param.grad is not None:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            if is_reporter:
                whole = whole + grad
        dist.all_reduce(whole)
        if param is not None:
            if isinstance(param, DTensor):
                param.grad = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
            else:
                param.grad = whole
