"""One plan stage on this rank: its segment of the graph, its mesh, DTensor parameters and module.

:func:`build_meshes` makes every stage's device mesh on every rank (DeviceMesh creates process
groups, a collective call). :func:`build_stage` returns the :class:`StagePart` of a stage this rank
belongs to: a :class:`~executors.graph_module.GraphModule` whose nodes run through
:class:`~executors.parallel.tensor_parallel.StageSharding`, wrapped so that it takes and returns whole
tensors (:class:`ShardedStageModule`) — what pipeline transfers and loss functions see.

A parameter read in several stages (tied embeddings) has a copy in each; :func:`sync_shared_grads`
sums their gradients over the world so every copy takes the same step.

A stage's memory-saving choices run here too: its recomputed runs (``Stage.recomputed_runs``) are
activation checkpoints of its :class:`~executors.graph_module.GraphModule`, and at ZeRO level 1
(``Stage.zero``) the optimizer steps shards of the parameters (:class:`ZeroOptimizerShards`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor

from executors.graph_module import GraphModule, Segment
from executors.parallel.grad_sync import GradReducer, SyncOptions, bucket_plan
from executors.parallel.tensor_parallel import SingleDeviceSharding, StageSharding, make_mesh
from planner.costing.overlap import stage_grad_entries
from planner.ir.graph import OpGraph
from planner.plan import Plan, Stage
from planner.plan.stage import loss_row_axes


def build_meshes(plan: Plan, *, device_type: str) -> list[DeviceMesh]:
    return [make_mesh(stage.devices, stage.mesh_shape, device_type=device_type) for stage in plan.stages]


@dataclass(frozen=True, kw_only=True)
class LossRows:
    """Where a last stage runs its loss on each rank's rows (:func:`planner.plan.stage.loss_row_axes`): the mesh
    ``axes`` its outputs' rows are split over, and the microbatch's ``rows``."""

    axes: tuple[int, ...]
    rows: int

    @staticmethod
    def of(plan: Plan, stage: Stage) -> LossRows | None:
        """The plan's split for its last stage ``stage``; None where the loss reads the whole outputs."""
        if not plan.outputs_batch_major or len(stage.devices) == 1:
            return None
        rows = plan.batch_size // plan.num_microbatches
        axes = loss_row_axes(stage.mesh_shape, rows=rows)
        return LossRows(axes=axes, rows=rows) if axes else None


@dataclass(frozen=True, kw_only=True)
class BoundaryShards:
    """The stage inputs (by position among forward's arguments) and outputs (among what it returns) that cross a
    pipeline boundary as shards, each with its spec (:func:`planner.plan.stage.boundary_spec`); the others cross
    whole."""

    inputs: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    outputs: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


class ShardedStageModule(nn.Module):
    """Whole tensors in, whole tensors out (or this rank's shards of those ``shards`` names); DTensors inside;
    optionally the loss at the end (on this rank's rows of the outputs under ``loss_rows``, scaled by its share)."""

    def __init__(
        self,
        inner: GraphModule,
        sharding: StageSharding | SingleDeviceSharding,
        *,
        loss: Callable[[tuple[Any, ...], tuple[Any, ...]], torch.Tensor] | None = None,
        loss_inputs: tuple[int, ...] = (),
        loss_rows: LossRows | None = None,
        wire_dtype: Callable[[torch.dtype], torch.dtype] | None = None,
        shards: BoundaryShards | None = None,
    ) -> None:
        super().__init__()
        self._shards = shards or BoundaryShards()
        self.inner = inner
        self.sharding = sharding
        self._loss = loss
        self._loss_inputs = loss_inputs  # positions of the graph inputs the loss reads among forward's args
        self._loss_rows = loss_rows
        self._wire_dtype = wire_dtype  # the dtype a sent value travels in (bf16 under mixed precision)

    def forward(self, *values: Any) -> Any:
        values = tuple(_ContiguousGrad.apply(v) if _needs_grad(v) else v for v in values)
        outputs = self.inner(*(self._enter(position, v) for position, v in enumerate(values)))
        loss_data = tuple(values[i] for i in self._loss_inputs)
        if self._loss is not None and self._loss_rows is not None:
            assert isinstance(self.sharding, StageSharding), "a one-device stage keeps whole outputs"
            axes, rows = self._loss_rows.axes, self._loss_rows.rows
            mine = tuple(self.sharding.leave_rows(v, axes) for v in outputs)
            data = tuple(self.sharding.rows_of(v, axes, rows=rows) for v in loss_data)
            share = math.prod(self.sharding.mesh.size(axis) for axis in axes)
            return self._loss(mine, data) / share
        if self._loss is None:  # sent to the next stage: point-to-point sends need contiguous tensors
            sent = tuple(self._leave(position, v) for position, v in enumerate(outputs))
            sent = tuple(_own_tensor(self._to_wire(v).contiguous()) if isinstance(v, torch.Tensor) else v for v in sent)
            return sent if len(sent) != 1 else sent[0]
        return self._loss(tuple(self.sharding.leave(v) for v in outputs), loss_data)

    def _enter(self, position: int, value: Any) -> Any:
        spec = self._shards.inputs.get(position)
        if spec and isinstance(value, torch.Tensor):
            assert isinstance(self.sharding, StageSharding), "shards cross only between stages of several devices"
            return self.sharding.enter_shards(value, spec)
        return self.sharding.enter(value)

    def _leave(self, position: int, value: Any) -> Any:
        spec = self._shards.outputs.get(position)
        if spec and isinstance(value, torch.Tensor):
            assert isinstance(self.sharding, StageSharding), "shards cross only between stages of several devices"
            return self.sharding.leave_shards(value, spec)
        return self.sharding.leave(value)

    def whole_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The loss of the whole microbatches from this rank's share of it (a collective over the rows' axes)."""
        if self._loss_rows is None:
            return value
        assert isinstance(self.sharding, StageSharding), "a one-device stage keeps whole outputs"
        return self.sharding.sum_over(value.clone(), self._loss_rows.axes)

    def _to_wire(self, value: torch.Tensor) -> torch.Tensor:
        return value if self._wire_dtype is None else value.to(self._wire_dtype(value.dtype))


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: a stage's input gradient is sent to the stage
    before point to point, which needs a contiguous tensor (a transposed convolution's or a ``cat``'s gradient may
    not be)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point()


def _own_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value``, copied if it is a view: zero-bubble schedules detach a stage's outputs in place after the input
    gradient (torch's ``stage_backward_input``), which a view does not allow."""
    return value.clone() if value._base is not None else value


@dataclass(kw_only=True)
class StagePart:
    stage: Stage
    segment: Segment
    module: ShardedStageModule
    sharding: StageSharding | SingleDeviceSharding
    params: dict[str, nn.Parameter]  # name -> what the optimizer steps: the (DTensor) parameter, or its ZeRO shard
    reducer: GradReducer | None = None  # the bucketed gradient reduction of a sharded stage
    zero: ZeroOptimizerShards | None = None  # ZeRO-1: the optimizer steps shards (Stage.zero ≥ 1)

    def sync_grads(self, *, divided_by: float = 1.0) -> None:
        """Gradients in their parameters' placements: the buckets (:mod:`executors.parallel.grad_sync`; ``divided_by``:
        what a pipeline schedule divided the gradients by after the backward), then anything left one by one;
        under ZeRO each rank's slice of them handed to its shards."""
        if self.reducer is not None:
            self.reducer.finish(divided_by=divided_by)
        self.sharding.sync_grads(list((self.zero.compute if self.zero else self.params).values()))
        if self.zero is not None:
            self.zero.scatter_grads()

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
    *,
    stage: Stage,
    graph: OpGraph,
    segment: Segment,
    mesh: DeviceMesh,
    model_params: Mapping[str, Any],
    model_buffers: Mapping[str, Any],
    device: str,
    loss: Callable[[tuple[Any, ...], tuple[Any, ...]], torch.Tensor] | None = None,
    loss_inputs: tuple[int, ...] = (),
    loss_rows: LossRows | None = None,
    wire_dtype: Callable[[torch.dtype], torch.dtype] | None = None,
    sync: SyncOptions | None = None,
    shards: BoundaryShards | None = None,
) -> StagePart:
    """The part of ``stage`` this rank runs, every node as the plan's record of it says; ``sync``: how it
    reduces its gradients (:meth:`executors.parallel.grad_sync.SyncOptions.of` the plan; None: exact, bucketed by
    4-byte gradients, after the backward); ``loss_rows``: where the last stage runs the loss on each rank's rows
    (:meth:`LossRows.of` the plan); ``shards``: the inputs and outputs that cross its pipeline boundaries as
    shards."""
    sharding: StageSharding | SingleDeviceSharding
    if len(stage.devices) == 1:
        sharding = SingleDeviceSharding(device=device)
    else:
        sharding = StageSharding(mesh=mesh, strategies=stage.strategies, graph=graph, device=device)
    specs = param_specs(stage, graph, segment.params)
    params = sharding.distribute_params({name: model_params[name] for name in segment.params}, specs)
    buffers = sharding.distribute_buffers({name: model_buffers[name] for name in segment.buffers})
    inner = GraphModule(
        graph,
        segment,
        params=params,
        buffers=buffers,
        call_node=sharding.call_node,
        device=device,
        checkpointed=stage.recomputed_runs(),
    )
    module = ShardedStageModule(
        inner, sharding, loss=loss, loss_inputs=loss_inputs, loss_rows=loss_rows, wire_dtype=wire_dtype, shards=shards
    )
    named = dict(inner.named_graph_parameters())
    zero = None
    if stage.zero >= 1 and len(stage.devices) > 1:
        axes = {entry.name: entry.axes for entry in stage_grad_entries(stage, graph)}
        zero = ZeroOptimizerShards(params=named, axes={name: axes[name] for name in named if axes.get(name)})
        module.register_forward_pre_hook(lambda *_: zero.gather())
    reducer = None
    if len(stage.devices) > 1:
        sync = sync or SyncOptions(optimizer="adam-fp32")
        reducer = GradReducer(
            params=named, buckets=bucket_plan(stage, graph, optimizer=sync.optimizer), mesh=mesh, options=sync
        )
    return StagePart(
        stage=stage,
        segment=segment,
        module=module,
        sharding=sharding,
        params=zero.optimized() if zero else named,
        reducer=reducer,
        zero=zero,
    )


class ZeroOptimizerShards:
    """ZeRO-1 on a sharded stage (Megatron's distributed optimizer; torch's ``ZeroRedundancyOptimizer`` scheme
    on DTensors): every parameter whose gradient is summed over mesh axes gets a *shard*, a DTensor split
    along one of its dims over those axes, which is what the optimizer steps — so each rank holds ``1/d`` of
    its optimizer state. After the gradient reduction (as at level 0) each shard takes its slice of the
    reduced gradient (no communication); before the first forward after that, each parameter is all-gathered
    from its updated shards (:meth:`gather`). Costs: :mod:`planner.costing.zero`."""

    def __init__(self, *, params: Mapping[str, nn.Parameter], axes: Mapping[str, tuple[int, ...]]) -> None:
        self.compute = dict(params)  # what the stage's module computes with
        self.shards: dict[str, nn.Parameter] = {}
        for name, param in params.items():
            placements = zero_placements(param, axes[name]) if name in axes and isinstance(param, DTensor) else None
            if placements is not None and param.requires_grad:
                whole = param.full_tensor().detach().clone()
                local = distribute_tensor(whole, param.device_mesh, placements, src_data_rank=None)
                self.shards[name] = nn.Parameter(local, requires_grad=True)
        self.stale = True  # the shards may differ from the parameters (a step, a checkpoint loaded)

    def optimized(self) -> dict[str, nn.Parameter]:
        """Name -> what the optimizer steps: the shard, or the parameter itself where nothing is sharded."""
        return {name: self.shards.get(name, param) for name, param in self.compute.items()}

    def scatter_grads(self) -> None:
        """Each shard's slice of its parameter's reduced gradient (a local slice), the parameter's freed."""
        for name, shard in self.shards.items():
            param = self.compute[name]
            if param.grad is None:
                continue
            grad = param.grad.redistribute(shard.device_mesh, shard.placements)
            shard.grad = grad if shard.grad is None else shard.grad + grad
            param.grad = None
        self.stale = True

    def gather(self) -> None:
        """The parameters all-gathered from their shards, once after every step (the forward pre-hook)."""
        if not self.stale:
            return
        with torch.no_grad():
            for name, shard in self.shards.items():
                param = self.compute[name]
                param._local_tensor.copy_(shard.redistribute(param.device_mesh, param.placements).to_local())
        self.stale = False


def zero_placements(param: DTensor, axes: Sequence[int]) -> tuple[Placement, ...] | None:
    """``param``'s placements with each axis of ``axes`` sharding the largest dim no other axis shards; None when
    every dim is taken (a bias split by the tensor axis): the shard would split a split dim again, which DTensor
    redistributes by all-gathering, so such a parameter is optimized whole (it is small)."""
    taken = {placement.dim for placement in param.placements if isinstance(placement, Shard)}
    free = [dim for dim in sorted(range(param.ndim), key=lambda d: -param.shape[d]) if dim not in taken]
    if not free:
        return None
    return tuple(Shard(free[0]) if axis in axes else placement for axis, placement in enumerate(param.placements))


def sync_shared_grads(
    parts: Sequence[StagePart], shared: Sequence[str], *, rank: int, device: str, metas: Mapping[str, torch.Tensor]
) -> None:
    """Sum each shared parameter's gradient over the stages that read it (every rank takes part; ``parts``
    are this rank's stages, several under an interleaved schedule, each reported by its first device)."""
    for name in shared:
        copies = [(part, part.params[name]) for part in parts if name in part.params]
        whole = torch.zeros_like(metas[name], device=device)
        for part, param in copies:
            if param.grad is not None:
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                if rank == part.stage.devices[0]:
                    whole = whole + grad
        dist.all_reduce(whole)
        for _, param in copies:
            if isinstance(param, DTensor):
                param.grad = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
            else:
                param.grad = whole
