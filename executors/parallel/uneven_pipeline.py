"""Pipelines whose stages have different device counts (an Alpa-style submesh per stage).

``torch.distributed.pipelining`` pairs one rank per stage in each pipeline group, so it needs
stages of equal size (:mod:`executors.parallel.pipeline`). Here the stages are the same
:class:`~executors.parallel.stages.StagePart` modules — DTensor inside, whole tensors at the boundaries —
and the transfers are point to point:

* forward: rank ``j`` of stage ``s`` receives the stage inputs from rank ``j mod |s−1|`` of stage
  ``s−1`` (every rank of a stage holds its outputs whole, so any of them can send);
* backward: rank ``k`` of stage ``s−1`` receives the gradients of its outputs from rank
  ``k mod |s|`` of stage ``s`` — exactly one sender per receiver, so nothing is counted twice.

The order is GPipe's (every microbatch forward, then every microbatch backward in reverse) for
either schedule of the plan; a 1F1B plan therefore runs with GPipe's activation memory. Sends are
non-blocking, receives blocking, and every rank walks the same order, so no rank waits on a
message that is sent later. Each microbatch loss is divided by ``m`` (the gradient of the mean).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executors.graph_module import model_output, model_tensors
from executors.parallel.grad_sync import SyncOptions
from executors.parallel.pipeline import stage_segments
from executors.parallel.stages import LossRows, StagePart, build_meshes, build_stage, sync_shared_grads
from executors.session import Workload, split_batch
from planner.costing.estimate import shared_params
from planner.ir.layers import needs_grad
from planner.ir.node_call import torch_dtype
from planner.plan import Plan


class UnevenPipelineRunner:
    def __init__(self, *, plan: Plan, workload: Workload, model: nn.Module) -> None:
        self.plan, self.workload = plan, workload
        self.m = plan.num_microbatches
        self.graph = workload.graph_at(plan.batch_size // self.m)
        loss_inputs = workload.loss_names(self.graph)
        self.segments = stage_segments(self.graph, plan, loss_inputs=loss_inputs)
        self.with_grad = needs_grad(self.graph)  # both ends of a transfer agree on which values carry gradients
        meshes = build_meshes(plan, device_type=workload.device.split(":")[0])
        self.rank = dist.get_rank()
        self.shared = shared_params(plan.stages, self.graph)
        self.param_metas = {name: p.detach() for name, p in model.named_parameters() if name in self.shared}
        where = [index for index, stage in enumerate(plan.stages) if self.rank in stage.devices]
        self.index = where[0] if where else None
        self.part: StagePart | None = None
        if self.index is None:
            return
        stage, last = plan.stages[self.index], self.index == len(plan.stages) - 1
        params, buffers = model_tensors(model)
        loss_fn = workload.loss_fn

        def loss(outputs: tuple[Any, ...], inputs: tuple[Any, ...]) -> torch.Tensor:
            return loss_fn(model_output(workload.graph, outputs), inputs)

        self.part = build_stage(
            stage=stage,
            graph=self.graph,
            segment=self.segments[self.index],
            mesh=meshes[self.index],
            model_params=params,
            model_buffers=buffers,
            device=workload.device,
            wire_dtype=workload.precision.wire_dtype,
            loss=loss if last else None,
            loss_inputs=tuple(self.segments[-1].inputs.index(n) for n in loss_inputs) if last else (),
            loss_rows=LossRows.of(plan, stage) if last else None,
            sync=SyncOptions.of(plan),
        )
        self.owned = set(stage.param_placements)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.part.params.values()) if self.part else []

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.part.params) if self.part else {}

    def step(self, inputs: tuple[Any, ...]) -> float:
        loss = torch.zeros((), device=self.workload.device)
        if self.part is not None:
            first = self.index == 0  # later stages receive their inputs; they read no data
            pieces = split_batch(inputs, num_chunks=self.m, batch_size=self.plan.batch_size) if first else [()] * self.m
            saved = [self._forward(piece) for piece in pieces]
            for received, outputs in reversed(saved):
                self._backward(received, outputs)
            if self.index == len(self.plan.stages) - 1:
                loss = torch.stack([outputs.detach() for _, outputs in saved]).mean()
                loss = self.part.module.whole_loss(loss)  # each rank ran the loss on its rows (LossRows)
            self.part.sync_grads()
        sync_shared_grads(
            [self.part] if self.part is not None else [],
            self.shared,
            rank=dist.get_rank(),
            device=self.workload.device,
            metas=self.param_metas,
        )
        dist.broadcast(loss, src=self.plan.stages[-1].devices[0])
        return float(loss)

    def _forward(self, piece: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        assert self.part is not None and self.index is not None
        if self.index == 0:
            received = tuple(piece)
        else:
            source = self._peer(self.index - 1)
            received = tuple(self._receive(name, source) for name in self.segments[self.index].inputs)
        outputs = self.part.module(*received)
        if self.index < len(self.plan.stages) - 1:
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            for peer in self._forward_peers():
                for value in outputs:
                    dist.send(value.detach().contiguous(), peer)
        return received, outputs

    def _backward(self, received: tuple[Any, ...], outputs: Any) -> None:
        assert self.index is not None
        if self.index == len(self.plan.stages) - 1:
            (outputs.sum() / self.m).backward()
        else:
            source = self._peer(self.index + 1)
            names = self.segments[self.index].outputs
            flowing = [value for name, value in zip(names, outputs, strict=True) if name in self.with_grad]
            grads = [self._receive_like(value, source) for value in flowing]
            pairs = [(value, grad) for value, grad in zip(flowing, grads, strict=True) if value.requires_grad]
            if pairs:
                torch.autograd.backward([value for value, _ in pairs], [grad for _, grad in pairs])
        if self.index == 0:
            return
        names = self.segments[self.index].inputs
        for peer in self._backward_peers():
            for name, value in zip(names, received, strict=True):
                if name in self.with_grad:
                    grad = value.grad if value.grad is not None else torch.zeros_like(value)
                    dist.send(grad.contiguous(), peer)

    def _position(self) -> int:
        assert self.index is not None
        return self.plan.stages[self.index].devices.index(self.rank)

    def _peer(self, stage_index: int) -> int:
        devices = self.plan.stages[stage_index].devices
        return devices[self._position() % len(devices)]

    def _forward_peers(self) -> list[int]:
        """Ranks of the next stage that receive this rank's outputs."""
        assert self.index is not None
        mine, following = len(self.plan.stages[self.index].devices), self.plan.stages[self.index + 1].devices
        return [rank for j, rank in enumerate(following) if j % mine == self._position()]

    def _backward_peers(self) -> list[int]:
        """Ranks of the previous stage that receive this rank's input gradients."""
        assert self.index is not None
        mine, previous = len(self.plan.stages[self.index].devices), self.plan.stages[self.index - 1].devices
        return [rank for k, rank in enumerate(previous) if k % mine == self._position()]

    def _receive(self, name: str, source: int) -> torch.Tensor:
        meta = self.workload.value_meta(self.graph, name, batch_size=self.plan.batch_size // self.m)
        dtype = self.workload.precision.wire_dtype(torch_dtype(meta.dtype))
        buffer = torch.empty(meta.shape, dtype=dtype, device=self.workload.device)
        dist.recv(buffer, source)
        return buffer.requires_grad_(name in self.with_grad)

    def _receive_like(self, value: torch.Tensor, source: int) -> torch.Tensor:
        buffer = torch.empty_like(value, requires_grad=False)
        dist.recv(buffer, source)
        return buffer

    def _reports(self) -> bool:
        return self.part is not None and self.rank == self.part.stage.devices[0]

    def gradients(self) -> dict[str, torch.Tensor]:
        if self.part is None:
            return {}
        grads = self.part.full_grads(self.owned)
        return grads if self._reports() else {}
