"""Delayed Gradient Averaging (Zhu et al. 2021, "Delayed Gradient Averaging: Tolerate the Communication Latency for
Federated Learning") as a DDP communication hook: the average of a step's gradients arrives ``D`` steps late, so its
all-reduce has ``D`` steps of computation to hide behind.

At step ``i`` each rank launches the all-reduce of a copy of its bucket and does not wait for it; it steps on

    ĝ(i) = ∇w(i) − ∇w(i − D) + avg ∇w(i − D)

(:func:`delayed_hook`): its own gradient now, corrected by the average it now holds from ``D`` steps before minus
its own gradient then (the paper's correction term: without it the replicas drift apart). The all-reduce launched
at ``i − D`` is waited for here, so a link slower than ``D`` steps of compute still stalls. :class:`DelayedState`
keeps, per bucket, the last ``D + 1`` steps' local copies and sums — ``2·(D + 1)`` buffers of the bucket's size.

The first ``warmup_steps`` steps (at least ``D + 1``: DDP rebuilds its buckets after the first step, and step
``i − D`` must be in the rebuilt layout) all-reduce exactly and fill the queue with their exact averages. DDP
only: a stage's partial sums are not replicas' gradients.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from planner.plan import GradSync


@dataclass(kw_only=True)
class _Sent:
    local: torch.Tensor  # this rank's gradient of the step
    summed: torch.Tensor  # the all-reduce's buffer: every rank's sum once ``work`` is done
    work: Any = None  # the async all-reduce (None: already complete)


@dataclass(kw_only=True)
class DelayedState:
    """A process group's DGA: the choice, the step count, the last ``D + 1`` steps per bucket index."""

    process_group: Any
    grad_sync: GradSync
    correction: bool = True  # False: the ablation that steps on the delayed average alone (benchmarks only)
    iteration: int = 0
    sent: dict[int, deque[_Sent]] = field(default_factory=dict)


def delayed_hook(state, bucket):  # DDP checks a hook's annotations against its own types: left unannotated
    """DDP communication hook of DGA (module docstring); returns a complete future of ``ĝ(i)``."""
    buffer = bucket.buffer()
    group, delay = state.process_group, state.grad_sync.delay
    world = dist.get_world_size(group)
    queue = state.sent.setdefault(bucket.index(), deque())
    summed = buffer.detach().clone()
    if state.iteration < state.grad_sync.warmup_steps:
        dist.all_reduce(summed, group=group)
        queue.append(_Sent(local=buffer.detach().clone(), summed=summed))
        buffer.copy_(summed / world)
    else:
        work = dist.all_reduce(summed, group=group, async_op=True)
        queue.append(_Sent(local=buffer.detach().clone(), summed=summed, work=work))
        old = queue[0]
        assert len(queue) == delay + 1 and old.local.shape == buffer.shape, "DGA's queue lost its step (a bug)"
        if old.work is not None:
            old.work.wait()
            old.work = None
        if state.correction:
            buffer.add_(old.summed / world - old.local)
        else:
            buffer.copy_(old.summed / world)
    while len(queue) > delay:
        queue.popleft()
    if bucket.is_last():
        state.iteration += 1
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
