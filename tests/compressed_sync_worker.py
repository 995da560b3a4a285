"""Run each gathered gradient sync as DDP's communication hook and check its result against a by-hand reconstruction.

Used by ``tests/test_compressed_sync.py``: ``torchrun --nproc-per-node N tests/compressed_sync_worker.py OUT.json``.
Per kind, a DDP model registers :func:`executors.parallel.grad_sync.register_ddp_hook` for a ``GradSync`` with 2 exact
warm-up steps; each rank trains 3 steps on its own batch. At the third (the first compressed one) every rank also
computes its local gradient without DDP, all-gathers everyone's, and reconstructs the mean the hook must give:
``mean_r D(C(g_r))`` with the rank's generator (seed ``RANK_SEED_STRIDE · r``: the random kinds run a one-parameter
model, one draw per step) — signSGD: the majority vote of the signs times the mean magnitude. Rank 0 writes, per kind,
the relative error of every parameter's gradient at every step (the exact warm-up's too). DGC and DGA
(:data:`STATEFUL`) run five steps against :class:`ByHand`, which keeps their state from every rank's gradients:
DGC's momentum and velocity per rank, DGA's own gradient and exact mean of every step (each rank checks its own
``∇w(i) − ∇w(i−D) + avg ∇w(i−D)``). DGC runs a second time with local gradient clipping (:data:`CLIPPED`,
a threshold small enough that every step clips): the model's gradients are one DDP bucket, so by hand each rank's
whole gradient is scaled by ``min(1, c·N^(−1/2) / (‖g‖ + 10⁻⁶))`` before its momentum; the factors are reported
under ``"clip factors"``.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from executors.compressed_sync import CLIP_EPSILON, RANK_SEED_STRIDE, DgcGradient, compressor_of, dgc_ratio
from executors.compressors import SignSGD, TopK, majority_vote, signs
from executors.parallel.grad_sync import register_ddp_hook
from executors.session import init_distributed
from planner.plan import GradSync

KINDS = ("topk:0.25", "onebit", "threshold:0.05", "terngrad", "qsgd:3", "signsgd")
STATEFUL = {"dgc:0.25": 2, "dga:2": 3}  # kinds whose state spans steps: their warm-up (5 steps each, by hand)
RANDOM = ("terngrad", "qsgd")
CLIPPED = ("dgc:0.25", 0.02)  # DGC with local clipping at this global threshold (the gradients' norms are ~0.1)


def model_for(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind.split(":")[0] in RANDOM:  # one gradient: the generator's draws are replayed by hand
        return nn.Linear(12, 6, bias=False)
    return nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 6))


def step_grads(model: nn.Module, rank: int, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=generator)
    model.zero_grad()
    model(x).pow(2).mean().backward()


def expected_mean(kind: str, local: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    grad_sync = GradSync.parse(kind)
    compressor = compressor_of(grad_sync)
    everyone = []
    for name, grad in local.items():
        gathered = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(gathered, grad)
        everyone.append((name, gathered))
    expected = {}
    for name, gathered in everyone:
        payloads = []
        for rank, grad in enumerate(gathered):
            generator = torch.Generator().manual_seed(RANK_SEED_STRIDE * rank)
            payloads.append(compressor.compress(grad, generator))
        if isinstance(compressor, SignSGD):
            scale = torch.stack([p.tensors["scale"] for p in payloads]).mean()
            expected[name] = (majority_vote([signs(p) for p in payloads]) * scale).reshape(gathered[0].shape)
        else:
            expected[name] = torch.stack([compressor.decompress(p) for p in payloads]).mean(0)
    return expected


def gathered_grads(local: dict[str, torch.Tensor], world: int) -> dict[str, list[torch.Tensor]]:
    out = {}
    for name, grad in local.items():
        everyone = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(everyone, grad)
        out[name] = everyone
    return out


class ByHand:
    """DGC's and DGA's results recomputed from every rank's local gradients, step by step."""

    def __init__(self, grad_sync: GradSync, rank: int, world: int, max_grad_norm: float | None = None) -> None:
        self.grad_sync, self.rank, self.world, self.max_grad_norm = grad_sync, rank, world, max_grad_norm
        self.clip_factors: list[float] = []  # every rank's local clipping factor at each compressed step
        self.dgc: dict[tuple[str, int], DgcGradient] = {}
        self.history: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []  # (own, mean) per step

    def expected(self, step: int, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        everyone = gathered_grads(local, self.world)
        mean = {name: torch.stack(grads).mean(0) for name, grads in everyone.items()}
        self.history.append((local, mean))
        if step < self.grad_sync.warmup_steps:
            return mean
        if self.grad_sync.kind == "dga":
            own, then = self.history[step - self.grad_sync.delay]
            return {name: local[name] - own[name] + then[name] for name in local}
        ratio = dgc_ratio(self.grad_sync, step - self.grad_sync.warmup_steps)
        clips = [self.clip_factor([grads[rank] for grads in everyone.values()]) for rank in range(self.world)]
        self.clip_factors.extend(clips)
        out = {}
        for name, grads in everyone.items():
            decoded = []
            for rank, grad in enumerate(grads):
                state = self.dgc.setdefault((name, rank), DgcGradient())
                decoded.append(TopK(ratio=ratio).decompress(state.step(grad * clips[rank], ratio=ratio)))
            out[name] = torch.stack(decoded).mean(0)
        return out

    def clip_factor(self, grads: list[torch.Tensor]) -> float:
        """DGC's local clipping of one rank's whole gradient (one bucket): ``min(1, c·N^(−1/2) / (‖g‖ + ε))``."""
        if self.max_grad_norm is None:
            return 1.0
        norm = torch.cat([grad.reshape(-1) for grad in grads]).norm()
        return min(1.0, self.max_grad_norm / self.world**0.5 / (float(norm) + CLIP_EPSILON))


def check_stateful(kind: str, rank: int, world: int, *, max_grad_norm: float | None = None) -> tuple[dict, ByHand]:
    grad_sync = GradSync(**{**GradSync.parse(kind).to_json(), "warmup_steps": STATEFUL[kind]})
    ddp = DistributedDataParallel(model_for(kind))
    register_ddp_hook(ddp, grad_sync=grad_sync, group=dist.group.WORLD, subgroup=None, max_grad_norm=max_grad_norm)
    plain, by_hand, errors = model_for(kind), ByHand(grad_sync, rank, world, max_grad_norm), {}
    for step in range(5):
        step_grads(ddp, rank, step)
        step_grads(plain, rank, step)
        want = by_hand.expected(step, {name: p.grad.detach().clone() for name, p in plain.named_parameters()})
        got = {name.removeprefix("module."): p.grad for name, p in ddp.named_parameters()}
        errors[f"step{step}"] = {name: relative(got[name], want[name]) for name in want}
    return errors, by_hand


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / (want.norm() + 1e-12))


def check(kind: str, rank: int, world: int) -> dict:
    grad_sync = GradSync.parse(kind)
    grad_sync = GradSync(**{**grad_sync.to_json(), "warmup_steps": 2})
    ddp = DistributedDataParallel(model_for(kind))
    register_ddp_hook(ddp, grad_sync=grad_sync, group=dist.group.WORLD, subgroup=None)
    plain = model_for(kind)
    errors = {}
    for step in range(3):
        step_grads(ddp, rank, step)
        step_grads(plain, rank, step)
        local = {name: p.grad.detach().clone() for name, p in plain.named_parameters()}
        if step < 2:  # exact warm-up: the plain mean
            want = {}
            for name, grad in local.items():
                dist.all_reduce(grad)
                want[name] = grad / world
        else:
            want = expected_mean(kind, local, world)
        got = {name.removeprefix("module."): p.grad for name, p in ddp.named_parameters()}
        errors[f"step{step}"] = {name: relative(got[name], want[name]) for name in want}
    return errors


def main() -> None:
    out = sys.argv[1]
    init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {kind: check(kind, rank, world) for kind in KINDS}
    report.update({kind: check_stateful(kind, rank, world)[0] for kind in STATEFUL})
    kind, max_grad_norm = CLIPPED
    report[f"{kind} clipped"], by_hand = check_stateful(kind, rank, world, max_grad_norm=max_grad_norm)
    report["clip factors"] = by_hand.clip_factors
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
