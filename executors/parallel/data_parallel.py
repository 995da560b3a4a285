"""Pure data-parallel stages: the whole model on every rank, DDP (or FSDP) over the stage's devices.

A one-stage plan whose parameters are all replicated is data parallelism whatever its activation
specs say, so it runs the way users run it: each rank interprets the graph captured at its share of
the batch (``B / (m·d)`` rows: the plan's microbatches, each split over ``d`` ranks) on plain
tensors, wrapped in ``DistributedDataParallel`` — bucketed gradient all-reduce overlapped with
backward, gradients averaged — with ``no_sync`` on all but the last microbatch, and a lossy gradient sync
the plan chose as torch's communication hook on it (:func:`executors.parallel.grad_sync.register_ddp_hook`; local
SGD's model averager runs in :meth:`DataParallelRunner.after_optimizer_step`). At a ZeRO level
(``Stage.zero`` ≥ 1) FSDP2 runs it instead: ``fully_shard`` on every layer group (:func:`fsdp_groups`, each
a child of :class:`~executors.graph_module.LayeredGraphModule`) and on the root (parameters several groups
read), as :mod:`planner.costing.zero` prices it — level 3 reshards after forward (parameters gathered
again for backward, prefetched a group ahead); levels 1 and 2 keep them gathered until the step's last
backward (``set_reshard_after_backward``); level 1 reduce-scatters the accumulated gradients in the last
backward only (``set_requires_gradient_sync``), 2 and 3 in every backward. The stage's recomputed runs are
activation checkpoints inside the groups (FSDP's hooks outside them). A stage that offloads (``Stage.offload``)
passes FSDP2's ``CPUOffloadPolicy`` to every ``fully_shard`` (:func:`fsdp_offload_policy`): the shards live in host
memory, each all-gather copies its shard in and each reduce-scatter its gradient shard out, and the optimizer
(built on the sharded parameters) steps on the CPU.

Batch normalization normalizes each replica's share (``Plan.batch_stat_rows``), and its running
statistics are averaged over the replicas after every step, so all replicas keep the same buffers.

The loss of a step is the mean of the ranks' losses, which equals the whole batch's loss for a
loss that averages over the batch (the model-file convention; pipelines assume it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from executors.graph_module import GraphModule, LayeredGraphModule, make_segment, model_output, model_tensors
from executors.parallel.grad_sync import local_sgd_subgroup, register_ddp_hook
from executors.session import Workload, split_batch
from planner.errors import AutoplanError
from planner.ir.graph import OpGraph
from planner.ir.layers import segments
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
        self.level, runs = stage.zero, stage.recomputed_runs()
        self.offload = stage.offload  # FSDP2's CPUOffloadPolicy (fsdp_offload_policy)
        self.module: GraphModule | LayeredGraphModule
        if self.level:  # FSDP shards layer by layer: one child module per layer group
            self.module = LayeredGraphModule(
                graph,
                segment,
                groups=fsdp_groups(graph, stage.nodes, runs=runs),
                params=params,
                buffers=buffers,
                device=workload.device,
                checkpointed=runs,
            )
        else:
            self.module = GraphModule(
                graph, segment, params=params, buffers=buffers, device=workload.device, checkpointed=runs
            )
        self.group = dist.new_group(list(stage.devices))
        self.subgroup = local_sgd_subgroup(plan, stage.devices)  # every rank creates the node groups
        self.rank = dist.get_rank()
        self.averager = None  # local SGD's model averager (executors.parallel.grad_sync.register_ddp_hook)
        self.compressed_sync = None  # our compressed hook's state (DGC's local clipping threshold)
        self.wrapped = self._wrap(workload.device)

    def _wrap(self, device: str) -> nn.Module:
        if self.rank not in self.devices:
            return self.module
        if self.level:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh(device.split(":")[0], torch.tensor(list(self.devices)))
            assert isinstance(self.module, LayeredGraphModule)
            policy = fsdp_offload_policy(offload=self.offload, device=device)
            for part in self.module.parts:  # level 3 frees each group's gathered parameters after its forward
                if part.segment.params:
                    fully_shard(part, mesh=mesh, reshard_after_forward=self.level == 3, offload_policy=policy)
            return fully_shard(self.module, mesh=mesh, reshard_after_forward=self.level == 3, offload_policy=policy)
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.device(device).index] if device.startswith("cuda") else None
        ddp = DistributedDataParallel(self.module, device_ids=device_ids, process_group=self.group)
        registered = register_ddp_hook(ddp, grad_sync=self.plan.grad_sync, group=self.group, subgroup=self.subgroup)
        self.averager, self.compressed_sync = registered.averager, registered.compressed
        return ddp

    def set_local_clip(self, max_grad_norm: float) -> None:
        """DGC's local gradient clipping threshold (the program's ``--max-grad-norm``), from the next step on."""
        if self.compressed_sync is not None:
            self.compressed_sync.max_grad_norm = max_grad_norm

    def after_optimizer_step(self) -> None:
        """Local SGD: average the parameters over the replicas every ``period`` steps (after the warm-up)."""
        if self.averager is not None:
            self.averager.average_parameters(self.module.parameters())

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
                if self.level and hasattr(self.wrapped, "set_requires_gradient_sync"):
                    # level 1 reduce-scatters once, in the last backward; 2 and 3 in every one. Parameters stay
                    # gathered until the step's last backward below level 3
                    self.wrapped.set_requires_gradient_sync(last or self.level >= 2)
                    self.wrapped.set_reshard_after_backward(last or self.level == 3)
                outputs = self.wrapped(*self.workload.model_inputs(piece))
                loss = self.workload.loss(model_output(self.workload.graph, outputs), piece) / self.num_microbatches
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


def fsdp_offload_policy(*, offload: bool, device: str) -> Any:
    """FSDP2's offload policy for a stage: ``CPUOffloadPolicy`` when it offloads (its shards of the parameters,
    gradients and optimizer state in host memory, the optimizer stepping on the CPU), pinned where an accelerator
    copies them (pinning needs one: on CPU ranks the shards already live in host memory and the policy's copies
    are no-ops), else the default policy (nothing offloaded)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=not device.startswith("cpu"))


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def fsdp_groups(graph: OpGraph, nodes: Sequence[str], *, runs: Sequence[Sequence[str]] = ()) -> list[list[str]]:
    """The groups FSDP shards a data-parallel plan by: consecutive nodes of one layer
    (:func:`planner.ir.layers.segments`, the groups :func:`planner.costing.zero.fsdp_groups` prices), a group
    merged with the next while a checkpointed run spans both."""
    chosen = set(nodes)
    groups = [[node.name for node in members if node.name in chosen] for _, members in segments(graph)]
    groups = [group for group in groups if group]
    run_of = {name: index for index, run in enumerate(runs) for name in run}
    merged: list[list[str]] = []
    for group in groups:
        if merged and group[0] in run_of and run_of.get(merged[-1][-1]) == run_of[group[0]]:
            merged[-1].extend(group)
        else:
            merged.append(list(group))
    return merged
