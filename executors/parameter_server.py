"""A parameter server (``GradSync`` ``ps`` ``S`` [``K``]) for one-stage data-parallel plans, over torch.distributed
point-to-point.

Layout (shared with its price, :mod:`planner.costing.sync.parameter_server`): the parameters are split into ``S``
shards of whole tensors (:func:`~planner.costing.sync.parameter_server.server_shards`), shard ``k`` served by rank
``server_ranks(devices, S)[k]``, a replica's own rank (co-located servers, as BytePS and MXNet's kvstore run them
on GPU clusters without spare CPU nodes). Every replica holds the whole model and computes its gradient on its
share of the batch (:class:`ParameterServerRunner`, DDP's runner without DDP). Then, each step ``t``:

1. push (:meth:`ParameterServer.push`): the replica flattens each shard's gradients and sends shard ``k`` to its
   server, which receives one from every replica (``batch_isend_irecv``: every transfer of the phase at once);
2. apply (:meth:`ParameterServer.apply`): a server waits for the pushes of step ``t − K`` (``K`` the staleness,
   0 for a synchronous server), averages the ``d`` gradients of its shard and sets them as its parameters'
   gradients; every other parameter's gradient is dropped (``None``), so the training loop's ``optimizer.step()``
   updates the served shards only and the optimizer state exists only there (torch's optimizers skip parameters
   without a gradient and create their state on first use). The gradient norm for clipping is the servers' shards'
   norms summed (:meth:`ParameterServer.squared_norm`, one all-reduce of a number);
3. pull (:meth:`ParameterServer.pull`, after ``optimizer.step()``): each server sends its shard's parameters to every
   other replica, which copies them in; every replica then holds the same parameters.

With ``K = 0`` the update is exact sync's (the average of the replicas' gradients, summed in another order); with
``K > 0`` the gradient of step ``t`` updates the parameters at step ``t + K`` (the first ``K`` steps update
nothing), so the replicas compute on parameters missing at most their last ``K`` updates: bounded staleness, the
push in flight for ``K`` steps. The loss is averaged by an all-reduce of one number, and batch normalization's
running statistics as under DDP (:class:`~executors.parallel.data_parallel.DataParallelRunner`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from executors.parallel.data_parallel import DataParallelRunner
from planner.costing.sync.parameter_server import server_ranks, server_shards

PUSH_TAG, PULL_TAG = 1, 2


@dataclass(kw_only=True)
class _Push:
    """One step's push in flight: its pending transfers, this rank's own flat gradient of the shard it serves and
    the buffers its server receives the others' into."""

    works: list[dist.Work]
    own: torch.Tensor | None
    received: list[torch.Tensor] = field(default_factory=list)


class ParameterServer:
    """The push, apply and pull of one data-parallel group (module docstring)."""

    def __init__(self, params: Sequence[nn.Parameter], *, devices: Sequence[int], servers: int, staleness: int) -> None:
        self.params, self.devices, self.staleness = list(params), tuple(devices), staleness
        self.servers = server_ranks(self.devices, servers)
        shard_of = server_shards([param.numel() for param in self.params], servers)
        self.shards = [[p for p, s in zip(self.params, shard_of, strict=True) if s == k] for k in range(servers)]
        self.rank = dist.get_rank()
        self.served = [k for k, server in enumerate(self.servers) if server == self.rank]
        assert len(self.served) <= 1, f"rank {self.rank} serves shards {self.served}: servers are distinct ranks"
        self.in_flight: deque[_Push] = deque()
        self.applied = False  # the last apply set gradients (a pull follows the optimizer step)

    def push(self) -> None:
        """Send each shard's gradient (flattened) to its server; a server posts the receives of its shard."""
        ops, own, received = [], None, []
        for k, server in enumerate(self.servers):
            flat = _flatten_grads(self.shards[k])
            if server != self.rank:
                ops.append(dist.P2POp(dist.isend, flat, peer=server, tag=PUSH_TAG))
                continue
            own = flat
            for replica in self.devices:
                if replica != self.rank:
                    received.append(torch.empty_like(flat))
                    ops.append(dist.P2POp(dist.irecv, received[-1], peer=replica, tag=PUSH_TAG))
        works = dist.batch_isend_irecv(ops) if ops else []
        self.in_flight.append(_Push(works=list(works), own=own, received=received))

    def apply(self) -> None:
        """Set the served shard's averaged gradient of ``K`` steps ago (none in the first ``K`` steps) and drop
        every other gradient."""
        for param in self.params:
            param.grad = None
        self.applied = len(self.in_flight) > self.staleness
        if not self.applied:
            return
        push = self.in_flight.popleft()
        for work in push.works:
            work.wait()
        for k in self.served:  # a rank serves at most one shard (servers are distinct ranks)
            assert push.own is not None
            total = push.own.clone()
            for buffer in push.received:
                total += buffer
            total /= len(self.devices)
            _unflatten_into_grads(total, self.shards[k])

    def squared_norm(self) -> torch.Tensor:
        """The squared norm of the gradients about to be applied, summed over the servers (a collective)."""
        device = self.params[0].device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for param in self.params:
            if param.grad is not None:
                total += param.grad.detach().square().sum(dtype=torch.float64)
        dist.all_reduce(total)
        return total

    def pull(self) -> None:
        """Each server sends its shard's parameters to every other replica, which copies them in."""
        if not self.applied:
            return
        ops, landing = [], []
        for k, server in enumerate(self.servers):
            if server == self.rank:
                flat = torch.cat([param.detach().reshape(-1) for param in self.shards[k]])
                ops.extend(
                    dist.P2POp(dist.isend, flat, peer=replica, tag=PULL_TAG)
                    for replica in self.devices
                    if replica != self.rank
                )
            else:
                buffer = torch.empty(
                    sum(p.numel() for p in self.shards[k]),
                    dtype=self.shards[k][0].dtype,
                    device=self.shards[k][0].device,
                )
                ops.append(dist.P2POp(dist.irecv, buffer, peer=server, tag=PULL_TAG))
                landing.append((k, buffer))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        with torch.no_grad():
            for k, buffer in landing:
                offset = 0
                for param in self.shards[k]:
                    param.copy_(buffer[offset : offset + param.numel()].view_as(param))
                    offset += param.numel()


def _flatten_grads(params: Sequence[nn.Parameter]) -> torch.Tensor:
    return torch.cat(
        [(param.grad if param.grad is not None else torch.zeros_like(param)).detach().reshape(-1) for param in params]
    )


def _unflatten_into_grads(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
    offset = 0
    for param in params:
        param.grad = flat[offset : offset + param.numel()].view_as(param).to(param.dtype).clone()
        offset += param.numel()


class ParameterServerRunner(DataParallelRunner):
    """DDP's runner without DDP: each replica computes its gradient, the parameter server syncs it."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        sync = self.plan.grad_sync
        self.server = ParameterServer(
            list(self.module.parameters()), devices=self.devices, servers=sync.servers, staleness=sync.staleness
        )

    def _wrap(self, device: str) -> nn.Module:
        return self.module

    def step_share(self, mine: tuple) -> float:
        loss = super().step_share(mine)
        self.server.push()
        self.server.apply()
        return loss

    def squared_grad_norm(self) -> torch.Tensor:
        return self.server.squared_norm()

    def after_optimizer_step(self) -> None:
        self.server.pull()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The gradients each server is about to apply, by name (the parity check merges every rank's)."""
        return {name: param.grad for name, param in self.module.named_graph_parameters() if param.grad is not None}
