"""One rank's part of a planned model, as a training program uses it.

:func:`parallelize` rebuilds the model from the plan (seeded, fingerprint checked), builds the
executor the plan needs (:func:`executors.runner.make_runner`) and returns a :class:`ParallelModel`:

* :meth:`ParallelModel.rank_info` — what this rank's data loader must yield (:mod:`executors.training.feed`);
* :meth:`ParallelModel.train_step` — forward and backward of one step over the plan's microbatches,
  under the run's precision (:mod:`executors.precision`), gradients synchronised; returns the loss
  of the whole global batch (the same number on every rank);
* :meth:`ParallelModel.clip_grad_norm_` — the global gradient norm, each parameter counted once
  however many ranks hold a copy or a shard of it, and every copy scaled by
  ``min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s rule);
* :meth:`ParallelModel.allocator_peak` — on CUDA, the allocator's peak allocated and reserved bytes (largest rank);
* :meth:`ParallelModel.named_parameters` — what this rank holds, by the model's parameter names
  (DTensors where the plan shards or replicates over a mesh);
* :meth:`ParallelModel.after_optimizer_step` — called after every ``optimizer.step()`` (local SGD averages
  the replicas' parameters there);
* :meth:`ParallelModel.full_state_dict` — every parameter whole, by the model's names, on rank 0 (for
  :mod:`executors.training.export_hf`).

``compile=True`` (``train.py --compile``) runs ``torch.compile`` on each stage's graph module
(:func:`compile_stages`); the plan's estimate assumes eager kernels as profiled, so a compiled run may beat it.

Each parameter name has one *reporter*: the lowest rank holding it. The gradient norm counts a
parameter on its reporter only; checkpoints (:mod:`executors.training.checkpoint`) are written by the
reporter, or for a DTensor by every rank of the reporter's mesh (each its shard).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from executors.precision import Precision
from executors.runner import Runner, make_runner
from executors.session import Workload, load_workload
from executors.training.feed import RankInfo, assemble, check_batch, data_feeders, rank_info, synthetic_batches
from executors.training.memory_probe import ActivationMeter, AllocatorPeak, allocator_peak, model_state_bytes
from executors.training.train_log import Throughput, throughput_unit
from planner.errors import AutoplanError
from planner.ir.model_file import ModelFile
from planner.plan import Plan
from planner.plan.schedules import Schedule

LossFn = Callable[[Any, Sequence[Any]], torch.Tensor]


class ParallelModel:
    def __init__(self, *, plan: Plan, workload: Workload, model: nn.Module, compile: bool = False) -> None:
        self.plan, self.workload = plan, workload
        self.runner: Runner = make_runner(plan, workload, model)
        self.compiled_modules = compile_stages(self.runner) if compile else 0
        self.rank = dist.get_rank()
        self.activation_peak_bytes: int | None = None  # set by train_step(measure_memory=True)
        feeders, self.feeds_share = data_feeders(plan)
        shared_batch = len(feeders) > 1 and not self.feeds_share and plan.batch_size % len(feeders) == 0
        self.feed_group = dist.new_group(list(feeders)) if shared_batch else None  # every rank calls new_group
        self._info = rank_info(plan, workload, rank=self.rank)
        self.held = self.runner.named_parameters()
        holders: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(holders, sorted(self.held))
        self.reporter = {}
        for rank, names in enumerate(holders):
            for name in names:
                self.reporter.setdefault(name, rank)

    @property
    def throughput(self) -> Throughput:
        """What the log counts per second: tokens for token-id inputs, else samples."""
        inputs = self.workload.graph.inputs
        return throughput_unit(self.plan, inputs[0].meta if inputs else None)

    @property
    def precision(self) -> Precision:
        return self.workload.precision

    def rank_info(self, *, start_step: int = 0) -> RankInfo:
        return replace(self._info, start_step=start_step)

    def synthetic_batches(self, info: RankInfo) -> Any:
        return synthetic_batches(self.workload.model_file, info, model_args=self.workload.model_args)

    def parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys(self.held.values()))

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.held)

    def train_step(self, batch: Sequence[Any] | None, *, measure_memory: bool = False) -> float:
        """Forward and backward over this step's batch (``None`` on a rank that reads no data);
        ``measure_memory`` records the peak bytes saved for backward (:mod:`executors.training.memory_probe`)."""
        if not measure_memory:
            return self._train_step(batch)
        with ActivationMeter() as meter:
            loss = self._train_step(batch)
        self.activation_peak_bytes = max(self.activation_peak_bytes or 0, meter.peak_bytes)
        return loss

    def memory_bytes(self, optimizer: torch.optim.Optimizer | None) -> int:
        """The largest, over the ranks, of model state + peak saved activations (a collective)."""
        local = model_state_bytes(self.parameters(), optimizer) + (self.activation_peak_bytes or 0)
        largest = torch.tensor(float(local), dtype=torch.float64, device=self.workload.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return int(largest)

    def allocator_peak(self) -> AllocatorPeak | None:
        """The CUDA allocator's peak allocated and reserved bytes, the largest over the ranks (a collective on
        CUDA); None on CPU, where tensors keep no allocator statistics (:func:`memory_bytes` stands in)."""
        local = allocator_peak(self.workload.device)
        if local is None:
            return None
        largest = torch.tensor(
            [local.allocated_bytes, local.reserved_bytes], dtype=torch.float64, device=self.workload.device
        )
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return AllocatorPeak(allocated_bytes=int(largest[0]), reserved_bytes=int(largest[1]))

    def _train_step(self, batch: Sequence[Any] | None) -> float:
        info = self._info
        if info.needs_data:
            assert batch is not None, "a rank that reads data must be given its batch"
            share = check_batch(batch, info, expected_len=info.num_inputs + len(self.workload.target_metas))
        else:
            share = ()
        with self.precision.autocast(self.workload.device):
            if self.feeds_share:
                return self.runner.step_share(share)  # type: ignore[attr-defined]
            whole = assemble(share, info, self.feed_group) if info.needs_data else ()
            return self.runner.step(whole)

    def grad_norm(self) -> float:
        """The gradient norm of the whole model (a collective over every rank)."""
        own_norm = getattr(self.runner, "squared_grad_norm", None)  # a parameter server: its shards' gradients
        if own_norm is not None:
            return float(own_norm().sqrt())
        total = torch.zeros((), dtype=torch.float64, device=self.workload.device)
        for name, param in self.held.items():
            if param.grad is None:
                continue
            squared = _squared_norm(param.grad)  # every rank of a DTensor's mesh holds it: they all take part
            if self.reporter[name] == self.rank:
                total += squared
        dist.all_reduce(total)
        return float(total.sqrt())

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient so the global norm is at most ``max_norm``; returns the norm before. Under DGC the
        threshold also becomes the hook's local clipping threshold from the next step on (DDP plans; compressed
        steps start after at least two exact ones, so every one of them clips locally)."""
        local_clip = getattr(self.runner, "set_local_clip", None)
        if local_clip is not None:
            local_clip(max_norm)
        norm = self.grad_norm()
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(coefficient)
        return norm

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.runner.gradients()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by the model's names, on CPU on rank 0 (``{}`` on the others; a collective):
        a DTensor is gathered from its shards by every rank of its mesh, in the same (sorted) order, and each
        parameter comes from its reporter."""
        mine = {}
        for name in sorted(self.held):
            param = self.held[name]
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            if self.reporter[name] == self.rank:
                mine[name] = whole.detach().to("cpu", copy=True)
        pieces: list[Any] | None = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        return {name: tensor for piece in pieces or [] for name, tensor in piece.items()}

    def after_optimizer_step(self) -> None:
        """What the plan's gradient sync does after each optimizer step (local SGD's parameter average;
        nothing for the other executors)."""
        after = getattr(self.runner, "after_optimizer_step", None)
        if after is not None:
            after()


def _squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The whole gradient's squared norm, summed in float64: a DTensor's local shard summed over the mesh axes
    that shard it (replicated axes hold copies). The squares are taken in the gradient's dtype and only the sum is
    float64: 12 bytes moved per fp32 element, where a float64 copy first moved 36 (part of the 21 ms per step the
    GPU check's GPT-1.3B program ran over the same eager step, benchmarks/results/gpu-2026-11-27.md); a relative
    error of ~1e-7, where an fp32 sum's was ~1e-5."""
    if not isinstance(grad, DTensor):
        return grad.detach().square().sum(dtype=torch.float64)
    squared = grad.to_local().detach().square().sum(dtype=torch.float64)
    for axis, placement in enumerate(grad.placements):
        assert not placement.is_partial(), "gradients are synchronised before their norm is taken"
        if placement.is_shard():
            dist.all_reduce(squared, group=grad.device_mesh.get_group(axis))
    return squared


def stage_modules(runner: Runner) -> list[nn.Module]:
    """The graph module of each stage this rank runs (inside its DTensor wrapper, or under DDP/FSDP)."""
    parts = list(getattr(runner, "parts", None) or [])
    single = getattr(runner, "part", None)
    if single is not None:
        parts.append(single)
    if parts:
        return [part.module.inner for part in parts]
    module = getattr(runner, "module", None)
    return [module] if isinstance(module, nn.Module) else []


def compile_stages(runner: Runner) -> int:
    """``torch.compile`` each stage's graph module in place (``nn.Module.compile``: parameters, hooks and wrappers
    stay); returns how many. The plan's estimate assumes eager kernels, as profiled."""
    modules = stage_modules(runner)
    for module in modules:
        module.compile()
    return len(modules)


def check_compile(plan: Plan) -> None:
    """--compile needs stage modules: operator placements (schedule dataflow) run operator by operator."""
    if plan.schedule == Schedule.DATAFLOW:
        raise AutoplanError(
            "--compile compiles each stage's module, and this plan's operator placements (schedule dataflow) run "
            "operator by operator: leave --compile off"
        )


def parallelize(
    plan: Plan,
    *,
    device: str,
    seed: int = 0,
    precision: Precision | None = None,
    dropout: bool = True,
    loss_fn: LossFn | None = None,
    build_model: Callable[[], nn.Module] | None = None,
    model_file: ModelFile | None = None,
    compile: bool = False,
) -> ParallelModel:
    """This rank's part of ``plan``'s model (the process group must be up). ``build_model`` and ``loss_fn``
    replace the model file's (the loss takes the output and the targets, or the inputs for files without
    targets); the model built must still have the plan's fingerprint. ``compile``: :func:`compile_stages`."""
    if compile:
        check_compile(plan)
    workload = load_workload(
        plan,
        seed=seed,
        device=device,
        dropout=dropout,
        precision=precision,
        build_fn=build_model,
        model_file=model_file,
        loss_fn=loss_fn,
    )
    model, _ = workload.build()
    return ParallelModel(plan=plan, workload=workload, model=model, compile=compile)
