"""Pure data-parallel stages: the whole model on every rank, DDP (or FSDP) over the stage's devices.

A one-stage plan whose parameters are all replicated is data parallelism whatever its activation
specs say, so it runs the way users run it: each rank interprets the graph captured at its share of
the batch (``B / (m·d)`` rows: the plan's microbatches, each split over ``d`` ranks) on plain
tensors, wrapped in ``DistributedDataParallel`` — bucketed gradient all-reduce overlapped with
backward, gradients averaged — with ``no_sync`` on all but the last microbatch. When the plan
shards optimizer state (``zero``), the module is wrapped with FSDP's ``fully_shard`` instead
(parameters, gradients and optimizer state sharded over the ranks, reduce-scatter of gradients).

Batch normalization normalizes each replica's share (``Plan.batch_stat_rows``), and its running
statistics are averaged over the replicas after every step, so all replicas keep the same buffers.

The loss of a step is the mean of the ranks' losses, which equals the whole batch's loss for a
loss that averages over the batch (the model-file convention; pipelines assume it too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from executors.graph_module import GraphModule, flat_outputs, make_segment, model_tensors
from executors.session import Workload, split_batch
from planner.errors import AutoplanError
from planner.plan import Plan


class DataParallelRunner:
    def __init__(self, *, plan: Plan, workload: Workload, model: nn.Module) -> None:
        stage = plan.stages[0]
        self.plan, self.workload = plan, workload
        self.devices = stage.devices
        self.num_replicas = len(stage.devices)
        self.num_microbatches = plan.num_microbatches
        shares = self.num_microbatches * self.num_replicas
        if plan.batch_size % shares:
            raise AutoplanError(f"batch {plan.batch_size} does not split into {shares} equal data-parallel shares")
        graph = workload.graph_at(plan.batch_size // shares)
        segment = make_segment(graph, stage.nodes, needed_after=graph.outputs)
        segment = replace(segment, inputs=tuple(v.name for v in graph.inputs))  # the model's inputs, in order
        params, buffers = model_tensors(model)
        self.module = GraphModule(graph, segment, params=params, buffers=buffers, device=workload.device)
        self.group = dist.new_group(list(stage.devices))
        self.rank = dist.get_rank()
        self.wrapped = self._wrap(workload.device)

    def _wrap(self, device: str) -> nn.Module:
        if self.rank not in self.devices:
            return self.module
        if self.plan.zero:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh(device.split(":")[0], torch.tensor(list(self.devices)))
            return fully_shard(self.module, mesh=mesh)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.device(device).index] if device.startswith("cuda") else None
        return DistributedDataParallel(self.module, device_ids=device_ids, process_group=self.group)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.module.named_graph_parameters())

    def step(self, inputs: tuple[Any, ...]) -> float:
        """One step on the whole batch: this replica trains on its share of it."""
        share = split_batch(inputs, num_chunks=self.num_replicas, batch_size=self.plan.batch_size)
        return self.step_share(share[self.devices.index(self.rank)])

    def step_share(self, mine: tuple[Any, ...]) -> float:
        """One step on this replica's own ``B/d`` rows (the loss returned is the whole batch's)."""
        pieces = split_batch(
            mine, num_chunks=self.num_microbatches, batch_size=self.plan.batch_size // self.num_replicas
        )
        total = torch.zeros((), device=self.workload.device)
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1
            context = self.wrapped.no_sync() if hasattr(self.wrapped, "no_sync") and not last else _Nothing()
            with context:
                if self.plan.zero and hasattr(self.wrapped, "set_requires_gradient_sync"):
                    self.wrapped.set_requires_gradient_sync(last)
                outputs = self.wrapped(*self.workload.model_inputs(piece))
                loss = self.workload.loss(flat_outputs(outputs), piece) / self.num_microbatches
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total, group=self.group)
        self._average_buffers()
        return float(total) / self.num_replicas

    def _average_buffers(self) -> None:
        """Running statistics (batch normalization) updated in place on each replica's share are averaged
        over the replicas, so every replica keeps the same buffers (an exponential average of the mean)."""
        for tensor in self.module._buffers_by_name.values():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                dist.all_reduce(tensor, group=self.group)
                tensor.div_(self.num_replicas)

    def gradients(self) -> dict[str, torch.Tensor]:
        grads = {}
        for name, param in self.module.named_graph_parameters():
            grad = param.grad
            if grad is not None:
                grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
        return grads if self.rank == self.devices[0] else {}


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
