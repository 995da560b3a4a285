"""A sharded (DTensor) stage's gradient reduction: buckets launched while the last backward runs.

Inside a tensor-parallel stage a parameter replicated on a mesh axis that splits its reader's compute gets
a partial-sum gradient there (DTensor ``Partial``), which must be summed over that axis before the
optimizer step. :class:`GradReducer` does it as DDP does for replicas:

* the buckets are the cost model's (:func:`bucket_plan`: :func:`planner.costing.overlap.stage_grad_entries`
  and :func:`planner.costing.overlap.stage_buckets` — DDP's caps, 1 MiB first then 25 MiB, gradients in
  gradient-ready order (reverse graph order), never split, one bucket per set of mesh axes, sized by the
  plan's gradient itemsize so that what runs is what was priced);
* a ``register_post_accumulate_grad_hook`` on every parameter counts its gradient's accumulations; in the
  ``num_backward``-th backward of the step (the last microbatch's; none before it, like DDP's ``no_sync``)
  a complete bucket is flattened (its local shards, one copy) and its all-reduce launched asynchronously
  over the axis's process group, buckets strictly in order so every rank issues the same collectives in
  the same order; a bucket summed over several axes goes after the backward, one axis after the other;
* :meth:`GradReducer.finish` (before the optimizer step) launches whatever is left, waits for every bucket
  and hands each parameter its reduced gradient, a view into the bucket, in the parameter's placements;
  gradients whose placements are not the planned partial sums (an operator run on whole tensors) are left
  to :meth:`executors.parallel.tensor_parallel.StageSharding.sync_grads`, which redistributes them one by one.

A lossy :class:`~planner.plan.GradSync` runs a DDP communication hook on the same buckets (the gathered kinds: ours,
:func:`executors.compressed_sync.compressed_hook`, one state per process group; the others torch's own):
``default_hooks.bf16_compress_hook`` or ``powerSGD_hook.powerSGD_hook`` with one ``PowerSGDState`` per
process group (``torch.distributed.GradBucket`` has no Python constructor in torch 2.13, so a bucket is
handed to them as :class:`HookBucket`, the part of its interface they read). The hooks average; a stage's
partial sums want the sum, so their result is multiplied by the group's size. On gloo a future's callbacks
run on the process group's own thread, where PowerSGD issues its second and third all-reduce: they would
race the main thread's collectives on the same group, so there each PowerSGD bucket completes before the
backward goes on (NCCL runs the callbacks inline).

``divided_by``: torch's pipeline schedules divide every gradient by the number of microbatches after the
backward (``scale_grads``); a bucket already launched by then holds undivided sums, divided on arrival.

DDP plans (:mod:`executors.parallel.data_parallel`) register the same hooks on DDP itself (:func:`register_ddp_hook`):
``bf16_compress_hook``, ``powerSGD_hook`` with a ``PowerSGDState``, ``compressed_hook`` with a
``CompressedSyncState``, ``delayed_hook`` (DGA) with a ``DelayedState``, or ``post_localSGD_hook`` with a
``PostLocalSGDState`` whose subgroup is each node's replicas (:func:`local_sgd_subgroup`) and a
``PeriodicModelAverager`` the runner calls after every optimizer step. DDP refuses to register a hook named
``bf16_compress_hook`` without NCCL, so on gloo it is called through :func:`bf16_hook`, and PowerSGD
completes each bucket before the backward goes on (:func:`completed`), as above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from cost_models.memory import optimizer_bytes
from executors.compressed_sync import CompressedSyncState, compressed_hook
from executors.delayed_sync import DelayedState, delayed_hook
from planner.costing.overlap import GradEntry, stage_buckets, stage_grad_entries
from planner.ir.graph import OpGraph
from planner.plan import GradSync, Plan, Stage
from planner.plan.schedules import Schedule


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """How a stage reduces its gradients: the plan's optimizer (bucket sizes), its gradient-sync choice, and
    the backward passes per step (None: every bucket after the backward, no overlap)."""

    optimizer: str
    grad_sync: GradSync = field(default_factory=GradSync)
    num_backward: int | None = None

    @classmethod
    def of(cls, plan: Plan) -> SyncOptions:
        """The plan's; a zero-bubble schedule adds weight gradients up itself, not through autograd's
        accumulation (torch's ``stage_backward_weight``): no hook sees them, so its buckets go after the backward."""
        overlap = plan.schedule != Schedule.ZERO_BUBBLE
        return cls(
            optimizer=plan.optimizer, grad_sync=plan.grad_sync, num_backward=plan.num_microbatches if overlap else None
        )


def bucket_plan(stage: Stage, graph: OpGraph, *, optimizer: str) -> list[tuple[GradEntry, ...]]:
    """The stage's gradient buckets, in launch order, exactly as the cost model packs them."""
    return stage_buckets(stage_grad_entries(stage, graph), grad_itemsize=optimizer_bytes(optimizer).grads)


class HookBucket:
    """What torch's DDP communication hooks read of a ``torch.distributed.GradBucket``."""

    def __init__(self, *, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor], last: bool) -> None:
        self._index, self._buffer, self._gradients, self._last = index, buffer, gradients, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return []

    def is_last(self) -> bool:
        return self._last


@dataclass(kw_only=True)
class _Launched:
    flat: torch.Tensor
    members: list[tuple[str, int, int]]  # (parameter, offset, numel) in flat
    early: bool  # launched during the backward (before any scaling after it)
    pending: list[Any] = field(default_factory=list)  # what is in flight: _Pending
    sources: list[Any] = field(default_factory=list)  # the gradients copied in (replaced since: a bug)


class GradReducer:
    def __init__(
        self,
        *,
        params: Mapping[str, nn.Parameter],
        buckets: Sequence[tuple[GradEntry, ...]],
        mesh: DeviceMesh,
        options: SyncOptions,
    ) -> None:
        self.params, self.mesh, self.grad_sync = params, mesh, options.grad_sync
        self.buckets = [bucket for bucket in buckets if all(entry.name in params for entry in bucket)]
        self.num_backward = options.num_backward
        self.overlap = options.num_backward is not None  # False: every bucket in finish (tests count them so)
        self._bucket_of = {entry.name: k for k, bucket in enumerate(self.buckets) for entry in bucket}
        self._states: dict[int, Any] = {}
        self._last_of_axis = {axis: k for k, bucket in enumerate(self.buckets) for axis in bucket[0].axes}
        self._reset()
        for name in self._bucket_of:
            params[name].register_post_accumulate_grad_hook(partial(self._on_grad, name))

    def _reset(self) -> None:
        self._count = dict.fromkeys(self._bucket_of, 0)
        self._waiting = [len(bucket) for bucket in self.buckets]
        self._launched: list[_Launched | None] = [None] * len(self.buckets)
        self._next = 0

    def _on_grad(self, name: str, param: torch.Tensor) -> None:
        self._count[name] += 1
        if not self.overlap or self._count[name] != self.num_backward:
            return
        k = self._bucket_of[name]
        self._waiting[k] -= 1
        while self._next < len(self.buckets) and self._waiting[self._next] == 0:
            if len(self.buckets[self._next][0].axes) > 1:  # several axes: after the backward, in finish
                break
            self._launched[self._next] = self._launch(self._next, early=True)
            self._next += 1

    def _reducible(self, entry: GradEntry) -> bool:
        """The gradient is what the plan says: a sum pending on the entry's axes, the parameter's placement
        elsewhere."""
        param = self.params[entry.name]
        grad = param.grad
        if not isinstance(grad, DTensor) or not isinstance(param, DTensor):
            return False
        for axis, (have, want) in enumerate(zip(grad.placements, param.placements, strict=True)):
            if axis in entry.axes:
                if not (have.is_partial() and getattr(have, "reduce_op", "sum") == "sum" and want.is_replicate()):
                    return False
            elif have != want:
                return False
        return True

    def _launch(self, k: int, *, early: bool) -> _Launched:
        bucket = self.buckets[k]
        chosen = [entry for entry in bucket if self._reducible(entry)]
        locals_ = [self.params[entry.name].grad.to_local() for entry in chosen]
        dtypes = {tensor.dtype for tensor in locals_}
        if len(dtypes) > 1:  # one dtype per collective: the others are left to the fallback
            first = locals_[0].dtype
            chosen, locals_ = zip(
                *[(e, t) for e, t in zip(chosen, locals_, strict=True) if t.dtype == first], strict=True
            )
        members, offset = [], 0
        for entry, tensor in zip(chosen, locals_, strict=True):
            members.append((entry.name, offset, tensor.numel()))
            offset += tensor.numel()
        flat = torch.cat([tensor.reshape(-1) for tensor in locals_]) if locals_ else torch.empty(0)
        launched = _Launched(
            flat=flat, members=members, early=early, sources=[self.params[entry.name].grad for entry in chosen]
        )
        if not members:
            return launched
        axes = bucket[0].axes
        if len(axes) == 1:
            launched.pending.append(self._reduce(k, flat, locals_, axes[0]))
        else:  # one axis after the other, each waited for before the next
            for axis in axes:
                self._reduce(k, flat, locals_, axis).wait()
        return launched

    def _reduce(self, k: int, flat: torch.Tensor, locals_: Sequence[torch.Tensor], axis: int) -> _Pending:
        group = self.mesh.get_group(axis)
        size = dist.get_world_size(group)
        kind = self.grad_sync.kind
        if kind == "exact":
            return _Pending(work=dist.all_reduce(flat, group=group, async_op=True), flat=flat, scale=1)
        views, offset = [], 0
        for tensor in locals_:
            views.append(flat[offset : offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        bucket = HookBucket(index=k, buffer=flat, gradients=views, last=self._last_of_axis[axis] == k)
        if kind == "bf16":
            future = default_hooks.bf16_compress_hook(group, bucket)
        elif self.grad_sync.gathered:
            future = compressed_hook(self._compressed_state(axis, group), bucket)
        else:
            assert kind == "powersgd", f"{kind} does not run on sharded stages (refused at planning time)"
            future = powerSGD_hook.powerSGD_hook(self._powersgd_state(axis, group), bucket)
            if dist.get_backend(group) == "gloo":
                future.wait()
        return _Pending(future=future, flat=flat, scale=size)

    def _powersgd_state(self, axis: int, group: Any) -> Any:
        if axis not in self._states:
            self._states[axis] = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=self.grad_sync.rank,
                start_powerSGD_iter=self.grad_sync.warmup_steps,
                random_seed=0,
            )
        return self._states[axis]

    def _compressed_state(self, axis: int, group: Any) -> CompressedSyncState:
        if axis not in self._states:
            self._states[axis] = CompressedSyncState(process_group=group, grad_sync=self.grad_sync)
        return self._states[axis]

    def finish(self, *, divided_by: float = 1.0) -> None:
        """Launch what is left, wait for every bucket, and give each parameter its reduced gradient."""
        for k in range(len(self.buckets)):
            if self._launched[k] is None:
                self._launched[k] = self._launch(k, early=False)
        for launched in self._launched:
            assert launched is not None
            for pending in launched.pending:
                pending.wait()
            if launched.early:
                replaced = [
                    name
                    for (name, _, _), grad in zip(launched.members, launched.sources, strict=True)
                    if self.params[name].grad is not grad
                ]
                assert not replaced, f"gradients replaced after their bucket went out: {replaced}"
            if launched.early and divided_by != 1 and launched.members:
                launched.flat.div_(divided_by)
            for name, offset, numel in launched.members:
                param = self.params[name]
                local = launched.flat[offset : offset + numel].view(param.grad.to_local().shape)
                param.grad = DTensor.from_local(
                    local,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
        counts = {n for n, c in self._count.items() if c not in (0, self.num_backward)} if self.overlap else set()
        assert not counts, f"gradients accumulated an unexpected number of times this step: {sorted(counts)}"
        self._reset()


@dataclass(kw_only=True)
class _Pending:
    """An all-reduce in flight: a ``Work`` (exact) or a hook's future (its value is the averaged bucket)."""

    flat: torch.Tensor
    scale: int
    work: Any = None
    future: Any = None
    done: bool = False

    def wait(self) -> torch.Tensor:
        if not self.done:
            if self.work is not None:
                self.work.wait()
            else:
                value = self.future.wait()
                if value is not self.flat:
                    self.flat.copy_(value)
                self.flat.mul_(self.scale)  # the hooks average; a stage's partial sums want the sum
            self.done = True
        return self.flat


# DDP checks a hook's annotations against the objects dist.GradBucket and Future[Tensor]; under postponed
# evaluation they are strings, so the two wrappers below are not annotated.
def bf16_hook(process_group, bucket):
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name without NCCL (gloo runs bf16)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def completed(hook: Any) -> Any:
    """``hook`` whose future is complete when it returns (PowerSGD on gloo: see the module docstring)."""

    def run(state, bucket):
        future = torch.futures.Future()
        future.set_result(hook(state, bucket).wait())
        return future

    return run


def local_sgd_subgroup(plan: Plan, devices: Sequence[int]) -> Any:
    """Each node's replicas as one process group, for local SGD (every rank must call it); None otherwise."""
    if plan.grad_sync.kind != "local-sgd":
        return None
    nodes: dict[int, list[int]] = {}
    for rank in devices:
        nodes.setdefault(plan.cluster.node_of(rank), []).append(rank)
    mine, _ = dist.new_subgroups_by_enumeration(list(nodes.values()))
    return mine


@dataclass(frozen=True, kw_only=True)
class DdpSync:
    """What :func:`register_ddp_hook` registered that the runner keeps: local SGD's model averager (to call after
    every optimizer step) and our compressed hook's state (DGC's local clipping threshold is set on it)."""

    averager: PeriodicModelAverager | None = None
    compressed: CompressedSyncState | None = None


def register_ddp_hook(
    ddp: nn.Module, *, grad_sync: GradSync, group: Any, subgroup: Any, max_grad_norm: float | None = None
) -> DdpSync:
    """Register ``grad_sync``'s torch hook on a ``DistributedDataParallel`` module. ``max_grad_norm``: DGC's local
    clipping threshold of the model's gradient (:func:`executors.compressed_sync.local_clip_scale`; None: none,
    until the runner sets the program's, :meth:`executors.parallel.data_parallel.DataParallelRunner.set_local_clip`)."""
    gloo = dist.get_backend(group) == "gloo"
    if grad_sync.kind == "bf16":
        ddp.register_comm_hook(group, bf16_hook if gloo else default_hooks.bf16_compress_hook)
    elif grad_sync.kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=grad_sync.rank,
            start_powerSGD_iter=grad_sync.warmup_steps,
            random_seed=0,
        )
        ddp.register_comm_hook(state, completed(powerSGD_hook.powerSGD_hook) if gloo else powerSGD_hook.powerSGD_hook)
    elif grad_sync.gathered:
        model_numel = sum(p.numel() for p in ddp.parameters() if p.requires_grad)
        state = CompressedSyncState(
            process_group=group, grad_sync=grad_sync, max_grad_norm=max_grad_norm, model_numel=model_numel
        )
        ddp.register_comm_hook(state, compressed_hook)
        return DdpSync(compressed=state)
    elif grad_sync.kind == "dga":
        ddp.register_comm_hook(DelayedState(process_group=group, grad_sync=grad_sync), delayed_hook)
    elif grad_sync.kind == "local-sgd":
        state = post_localSGD_hook.PostLocalSGDState(
            process_group=group, subgroup=subgroup, start_localSGD_iter=grad_sync.warmup_steps
        )
        ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(
            period=grad_sync.period, warmup_steps=grad_sync.warmup_steps, process_group=group
        )
        return DdpSync(averager=averager)
    return DdpSync()
