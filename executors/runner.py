"""The interface every executor offers the training loop, and the one-stage tensor-parallel runner.

A :class:`Runner` holds this rank's share of the model. ``step(inputs)`` runs forward and backward
over the plan's microbatches, synchronises gradients as the plan says and returns the step's loss
(the same number on every rank); ``gradients()`` is a collective that returns the whole gradient
of every parameter this rank reports (each parameter is reported by exactly one rank), for parity
checks. :func:`make_runner` picks the executor a plan needs:

* ``dataflow`` placements -> :class:`executors.parallel.placement.PlacementRunner`;
* several stages -> :class:`executors.parallel.pipeline.PipelineRunner` (tensor parallel inside stages), or
  :class:`executors.parallel.uneven_pipeline.UnevenPipelineRunner` when the stages differ in device count;
* one stage whose parameters are all replicated -> :class:`executors.parallel.data_parallel.DataParallelRunner`
  (DDP, or FSDP when the plan shards optimizer state);
* one stage otherwise -> :class:`TensorParallelRunner`.

:func:`load_cpu_runner` builds a saved plan's runner on a CPU rank (seed 0), as the measuring jobs and
workers do.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from executors.graph_module import make_segment, model_output, model_tensors
from executors.parallel.grad_sync import SyncOptions
from executors.parallel.stages import LossRows, build_meshes, build_stage
from executors.session import Workload, load_workload, split_batch
from planner.errors import AutoplanError
from planner.plan import Plan, load_plan
from planner.plan.schedules import Schedule


class Runner(Protocol):
    def parameters(self) -> list[nn.Parameter]: ...

    def named_parameters(self) -> dict[str, nn.Parameter]: ...

    def step(self, inputs: tuple[Any, ...]) -> float: ...

    def gradients(self) -> dict[str, torch.Tensor]: ...


def check_grad_sync(plan: Plan) -> None:
    """Refuse a lossy gradient sync this plan's executor cannot run as it was priced (a hand-edited plan)."""
    from planner.costing.compression import refusal
    from planner.costing.zero import runs_as_fsdp

    fsdp = runs_as_fsdp(plan.stages)  # ZeRO-1 on sharded stages keeps their buckets: only FSDP refuses a hook
    ddp = plan.is_pure_data_parallel and not plan.zero
    reason = refusal(plan.grad_sync, plan.stages, zero=fsdp, cluster=plan.cluster, ddp=ddp, optimizer=plan.optimizer)
    if plan.grad_sync.lossy and plan.schedule == Schedule.DATAFLOW:
        reason = "op placements run no gradient sync to compress"
    if reason:
        raise AutoplanError(f"grad_sync {plan.grad_sync.label}: {reason}")


def make_runner(plan: Plan, workload: Workload, model: nn.Module) -> Runner:
    check_grad_sync(plan)
    if plan.schedule == Schedule.DATAFLOW:
        from executors.parallel.placement import PlacementRunner

        return PlacementRunner(plan=plan, workload=workload, model=model)
    if len(plan.stages) > 1:
        from executors.parallel.pipeline import PipelineRunner, check_pipeline

        if check_pipeline(plan) is None:
            from executors.parallel.uneven_pipeline import UnevenPipelineRunner

            return UnevenPipelineRunner(plan=plan, workload=workload, model=model)
        return PipelineRunner(plan=plan, workload=workload, model=model)
    if plan.is_pure_data_parallel and plan.grad_sync.kind == "ps":
        from executors.parameter_server import ParameterServerRunner

        return ParameterServerRunner(plan=plan, workload=workload, model=model)
    if plan.is_pure_data_parallel:
        from executors.parallel.data_parallel import DataParallelRunner

        return DataParallelRunner(plan=plan, workload=workload, model=model)
    return TensorParallelRunner(plan=plan, workload=workload, model=model)


def load_cpu_runner(path: str | Path) -> tuple[Workload, Runner, tuple[Any, ...]]:
    """The plan saved at ``path`` built on this CPU rank as ``plan run`` builds it (seed 0): its workload
    (the plan is ``workload.plan``), this rank's runner and the model's inputs at the plan's batch size."""
    workload = load_workload(load_plan(path), seed=0, device="cpu")
    model, inputs = workload.build()
    return workload, make_runner(workload.plan, workload, model), inputs


class TensorParallelRunner:
    """One stage on its mesh; microbatches accumulate gradients one after another."""

    def __init__(self, *, plan: Plan, workload: Workload, model: nn.Module) -> None:
        self.plan, self.workload = plan, workload
        self.num_microbatches = plan.num_microbatches
        graph = workload.graph_at(plan.batch_size // self.num_microbatches)
        stage = plan.stages[0]
        loss_names = workload.loss_names(graph)
        names = tuple(v.name for v in graph.inputs)  # the model's inputs, in order, then the targets the loss reads
        segment = make_segment(graph, stage.nodes, needed_after=graph.outputs)
        segment = replace(segment, inputs=names + tuple(name for name in loss_names if name not in names))
        mesh = build_meshes(plan, device_type=workload.device.split(":")[0])[0]
        params, buffers = model_tensors(model)
        loss_fn = workload.loss_fn

        def loss(outputs: tuple[Any, ...], data: tuple[Any, ...]) -> torch.Tensor:
            return loss_fn(model_output(workload.graph, outputs), data)

        self.part = build_stage(
            stage=stage,
            graph=graph,
            segment=segment,
            mesh=mesh,
            model_params=params,
            model_buffers=buffers,
            device=workload.device,
            loss=loss,
            loss_inputs=tuple(segment.inputs.index(name) for name in loss_names),
            loss_rows=LossRows.of(plan, stage),
            sync=SyncOptions.of(plan),
        )

    def parameters(self) -> list[nn.Parameter]:
        return list(self.part.params.values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.part.params)

    def step(self, inputs: tuple[Any, ...]) -> float:
        total = torch.zeros((), device=self.workload.device)
        pieces = split_batch(inputs, num_chunks=self.num_microbatches, batch_size=self.plan.batch_size)
        for piece in pieces:
            loss = self.part.module(*piece) / self.num_microbatches  # the loss on this rank's rows (LossRows)
            loss.backward()
            total += loss.detach()
        self.part.sync_grads()
        return float(self.part.module.whole_loss(total))

    def gradients(self) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        grads = self.part.full_grads(set(self.part.params))
        return grads if dist.get_rank() == self.part.stage.devices[0] else {}
