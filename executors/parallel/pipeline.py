"""Pipeline stages from the plan -> torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B, zero bubble).

The captured graph (at the microbatch size ``B/m``) is split at the plan's stage boundaries
(:func:`stage_segments`): stage ``s`` reads what earlier stages (or the data) made and it uses, and
hands on every value a later stage reads — values skipping a stage pass through it. The last stage
also computes the loss (``loss_fn(output, inputs)``, the model inputs it needs being passed along),
so the schedule's loss function is the identity.

Stages with ``k`` devices each (stages of different sizes run under
:mod:`executors.parallel.uneven_pipeline`) form ``k`` pipeline groups: group ``i`` holds device ``i`` of every
stage's mesh, and runs one ``PipelineStage`` per stage with ``ScheduleGPipe`` or ``Schedule1F1B`` and
the plan's number of microbatches — or, under ``interleaved`` and ``zero-bubble``
(:mod:`planner.plan.schedules`), the stages ``k ≡ r (mod P)`` of its rank ``r`` with
``ScheduleInterleaved1F1B`` or ``ScheduleInterleavedZeroBubble`` (which runs each backward as torch's
input-gradient and weight-gradient halves). Inside a stage every rank computes with DTensor on its mesh
(:mod:`executors.parallel.stages`); rank ``i`` of the next stage receives a boundary value from rank ``i`` of
this one: whole (replicated on every rank), or, where the two stages' meshes have one shape, this rank's shard of a
value the stage computed, in the spec its output spec leaves it in (:func:`boundary_shards`,
:func:`planner.plan.stage.boundary_spec`). The last stage runs the loss on each rank's rows of
the model's outputs when the plan says they are batch-major (:func:`planner.plan.stage.loss_row_axes`); the step's
loss is the sum of the ranks' shares.

Gradients: the schedule scales them by ``1/m`` (each microbatch loss is a mean), partial sums on
data-parallel axes are all-reduced per stage, and a parameter read by several stages (tied
embeddings) has its gradients summed over them (:func:`executors.parallel.stages.sync_shared_grads`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executors.graph_module import Segment, make_segment, model_output, model_tensors
from executors.parallel.grad_sync import SyncOptions
from executors.parallel.receive_buffers import ReleasingStage
from executors.parallel.stages import BoundaryShards, LossRows, StagePart, build_meshes, build_stage, sync_shared_grads
from executors.session import Workload
from planner.costing.estimate import shared_params
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph
from planner.plan import Plan
from planner.plan.schedules import Schedule, split_backward_refusal
from planner.plan.stage import sends_shards, sent_spec

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero-bubble": "ScheduleInterleavedZeroBubble",
}


def stage_segments(graph: OpGraph, plan: Plan, *, loss_inputs: tuple[str, ...]) -> list[Segment]:
    """One segment per stage; the first takes every graph input, in order."""
    stage_of = {name: stage.index for stage in plan.stages for name in stage.nodes}
    segments = []
    for position, stage in enumerate(plan.stages):
        later = [
            value
            for node in graph.nodes
            if stage_of[node.name] > position
            for value in node.inputs
            if graph.value_kind(value).value in ("node", "input")
            and (value not in stage_of or stage_of[value] <= position)
        ]
        last = position == len(plan.stages) - 1
        needed = list(graph.outputs) if last else [*later, *loss_inputs]
        segment = make_segment(graph, stage.nodes, needed_after=needed)
        if position == 0:  # the model's inputs in order, then the targets the loss reads
            names = tuple(v.name for v in graph.inputs)
            segment = replace(segment, inputs=names + tuple(n for n in loss_inputs if n not in names))
        elif last:  # the loss reads model inputs the last stage's nodes may not
            extra = tuple(name for name in loss_inputs if name not in segment.inputs)
            segment = replace(segment, inputs=segment.inputs + extra)
        segments.append(segment)
    return segments


def check_pipeline(plan: Plan) -> int | None:
    """The schedule must be a pipeline's; returns the devices per stage, or None when the stages
    differ in size (run by :class:`executors.parallel.uneven_pipeline.UnevenPipelineRunner`)."""
    if plan.schedule not in SCHEDULE_CLASSES:
        raise AutoplanError(
            f"a pipeline plan needs schedule {', '.join(SCHEDULE_CLASSES)}, this one says '{plan.schedule}'"
        )
    sizes = {len(stage.devices) for stage in plan.stages}
    width = sizes.pop() if len(sizes) == 1 else None
    if width is None and plan.virtual_stages > 1:
        raise AutoplanError("stages of different sizes cannot hold several stages per rank: re-plan")
    return width


class PipelineRunner:
    def __init__(self, *, plan: Plan, workload: Workload, model: nn.Module) -> None:

        width = check_pipeline(plan)
        assert width is not None, "stages of different sizes run under UnevenPipelineRunner"
        self.plan, self.workload = plan, workload
        microbatch = plan.batch_size // plan.num_microbatches
        graph = workload.graph_at(microbatch)
        loss_inputs = workload.loss_names(graph)
        segments = stage_segments(graph, plan, loss_inputs=loss_inputs)
        lost = split_backward_refusal(graph, plan.stages) if plan.schedule == Schedule.ZERO_BUBBLE else None
        if lost is not None:
            raise AutoplanError(f"this plan cannot run exactly: {lost}")
        meshes = build_meshes(plan, device_type=workload.device.split(":")[0])
        homes = plan.stages[: plan.num_pipeline_ranks]  # stage k runs on the devices of stage k mod P
        groups = [dist.new_group([stage.devices[i] for stage in homes]) for i in range(width)]
        self.rank = dist.get_rank()
        self.shared = shared_params(plan.stages, graph)
        self.param_metas = {name: p.detach() for name, p in model.named_parameters() if name in self.shared}
        self.owned = {name for stage in plan.stages if self.rank in stage.devices for name in stage.param_placements}
        self.parts: list[StagePart] = []
        self.schedule = None
        self.pipeline_stages: list[ReleasingStage] = []
        mine = [stage for stage in plan.stages if self.rank in stage.devices]
        if not mine:
            return
        position = mine[0].devices.index(self.rank)
        params, buffers = model_tensors(model)
        count = len(plan.stages)
        pipeline_stages = []
        crossing = boundary_shards(graph, plan, segments)
        examples = partial(_examples, workload, graph, batch_size=microbatch)
        for stage in mine:
            index, last = stage.index, stage.index == count - 1
            part = build_stage(
                stage=stage,
                graph=graph,
                segment=segments[index],
                mesh=meshes[index],
                model_params=params,
                model_buffers=buffers,
                device=workload.device,
                wire_dtype=workload.precision.wire_dtype,
                loss=self._loss() if last else None,
                loss_inputs=tuple(segments[-1].inputs.index(name) for name in loss_inputs) if last else (),
                loss_rows=LossRows.of(plan, stage) if last else None,
                sync=SyncOptions.of(plan),
                shards=crossing[index],
            )
            self.parts.append(part)
            pipeline_stages.append(
                ReleasingStage(
                    part.module,
                    index,
                    count,
                    torch.device(workload.device),
                    input_args=examples(segments[index].inputs, crossing[index].inputs, stage.mesh_shape),
                    output_args=examples(segments[index].outputs, crossing[index].outputs, stage.mesh_shape)
                    if not last
                    else torch.zeros(1, device=workload.device),
                    group=groups[position],
                )
            )
        self.pipeline_stages = pipeline_stages
        self.schedule = _schedule(plan, pipeline_stages)
        self.is_first = mine[0].index == 0
        self.is_last = mine[-1].index == count - 1

    def _loss(self):
        loss_fn, graph = self.workload.loss_fn, self.workload.graph

        def loss(outputs: tuple[Any, ...], inputs: tuple[Any, ...]) -> torch.Tensor:
            # a [1] per microbatch: the schedule concatenates
            return loss_fn(model_output(graph, outputs), inputs).reshape(1)

        return loss

    def parameters(self) -> list[nn.Parameter]:
        return [param for part in self.parts for param in part.params.values()]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {name: param for part in self.parts for name, param in part.params.items()}

    def step(self, inputs: tuple[Any, ...]) -> float:
        loss = torch.zeros((), device=self.workload.device)
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            target = torch.zeros(self.plan.batch_size, device=self.workload.device)
            args = inputs if self.is_first else ()
            kwargs = {"target": target, "losses": losses} if self.is_last else {}
            self.schedule.step(*args, **kwargs)
            held = sum(stage.held_receive_buffers() for stage in self.pipeline_stages)
            assert held == 0, f"{held} receive buffer(s) outlived their microbatch (executors.parallel.receive_buffers)"
            if self.is_last:
                loss = torch.cat([value.detach().reshape(1) for value in losses]).mean()
                loss = self.parts[-1].module.whole_loss(loss)  # each rank ran the loss on its rows (LossRows)
            for part in self.parts:  # the schedule divided the gradients by m after the backward (scale_grads)
                part.sync_grads(divided_by=self.plan.num_microbatches)
        sync_shared_grads(self.parts, self.shared, rank=self.rank, device=self.workload.device, metas=self.param_metas)
        last_stage = self.plan.stages[-1]
        dist.broadcast(loss, src=last_stage.devices[0])
        return float(loss)

    def gradients(self) -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        for part in self.parts:  # each a collective over its stage's mesh, in stage order on every member
            found = part.full_grads(self.owned)
            if self.rank == part.stage.devices[0]:
                grads.update(found)
        return grads


def _schedule(plan: Plan, pipeline_stages: list[Any]) -> Any:
    """torch's schedule of the plan's kind over this rank's pipeline stages (the loss is each stage's output)."""
    from torch.distributed import pipelining

    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[plan.schedule])
    # single-stage schedule classes take the stage, not a list
    one = plan.schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
    return schedule_class(
        pipeline_stages[0] if one else pipeline_stages,
        n_microbatches=plan.num_microbatches,
        loss_fn=lambda output, target: output.sum(),
    )


def boundary_shards(graph: OpGraph, plan: Plan, segments: list[Segment]) -> list[BoundaryShards]:
    """Per stage, the inputs and outputs that cross its boundaries as shards: each value stage ``s`` computed and
    sends to ``s + 1`` when :func:`planner.plan.stage.sends_shards` holds, in the spec
    :func:`planner.plan.stage.sent_spec` reads off its output spec; stage ``s + 1`` enters it so."""
    sent: list[dict[str, tuple[str, ...]]] = []
    shapes = [stage.mesh_shape for stage in plan.stages]
    for index, (stage, segment) in enumerate(zip(plan.stages, segments, strict=True)):
        found: dict[str, tuple[str, ...]] = {}
        if sends_shards(shapes, index):
            for name in segment.outputs:
                record = stage.strategies.get(name)
                spec = (
                    None
                    if record is None
                    else sent_spec(graph.node(name), record.output_spec, mesh_shape=stage.mesh_shape)
                )
                if spec is not None:
                    found[name] = spec
        sent.append(found)
    return [
        BoundaryShards(
            inputs={p: sent[s - 1][n] for p, n in enumerate(segment.inputs) if s and n in sent[s - 1]},
            outputs={p: sent[s][n] for p, n in enumerate(segment.outputs) if n in sent[s]},
        )
        for s, segment in enumerate(segments)
    ]


def _examples(
    workload: Workload,
    graph: OpGraph,
    names: tuple[str, ...],
    shards: Mapping[int, tuple[str, ...]],
    mesh_shape: tuple[int, ...],
    *,
    batch_size: int,
) -> tuple[torch.Tensor, ...]:
    """Empty tensors with each boundary value's shape and dtype (no shape inference needed): this rank's shard of
    those that cross as shards (``shards``: position -> spec on ``mesh_shape``, the stage's and its neighbour's)."""
    from planner.ir.node_call import torch_dtype

    metas = []
    for position, name in enumerate(names):
        meta = workload.value_meta(graph, name, batch_size=batch_size)
        dtype = workload.precision.wire_dtype(torch_dtype(meta.dtype))
        shape = list(meta.shape)
        for axis, placement in enumerate(shards.get(position, ())):
            if placement != "R":
                shape[int(placement[2:-1])] //= mesh_shape[axis]
        example = torch.empty(shape, dtype=dtype, device=workload.device)
        metas.append(example.requires_grad_(example.is_floating_point()))
    return tuple(metas)
