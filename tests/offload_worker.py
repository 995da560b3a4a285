"""One data-parallel plan with CPU offload (FSDP2 ``CPUOffloadPolicy``) under torchrun, checked against one process.

``python -m torch.distributed.run --nproc-per-node N tests/offload_worker.py OUT.json PLAN.json``: two AdamW steps
with ``--check-parity`` semantics (the loss and every gradient against the user's module in one process), then the
optimizer state after them (each parameter's ``exp_avg`` and ``exp_avg_sq``, gathered from its shards) against the
reference's by relative norm. Rank 0 writes the report.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from executors.precision import Precision, make_optimizer
from executors.session import init_distributed
from executors.training.parallel_model import parallelize
from executors.training.parity_check import ParityCheck
from planner.plan import load_plan

OPTIMIZER, LR, STEPS = "adam-fp32", 1e-3, 2


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _offloaded(model) -> bool:
    """Whether FSDP2 runs the stage with ``CPUOffloadPolicy`` (every sharded parameter offloaded)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    wrapped = model.runner.wrapped
    if not isinstance(wrapped, FSDPModule):
        return False
    groups = [m._get_fsdp_state()._fsdp_param_group for m in wrapped.modules() if isinstance(m, FSDPModule)]
    return all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g is not None)


def main() -> None:
    out, path = sys.argv[1:]
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=120)
    plan = load_plan(path)
    model = parallelize(plan, device="cpu", seed=0, precision=Precision.for_optimizer(OPTIMIZER), dropout=False)
    optimizer = make_optimizer(OPTIMIZER, model.parameters(), lr=LR)
    parity = ParityCheck(model, make_optimizer=lambda params: make_optimizer(OPTIMIZER, params, lr=LR))
    batches = model.synthetic_batches(model.rank_info())
    steps = []
    for _ in range(STEPS):
        batch = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = model.train_step(batch)
        verdict = parity.check(batch, loss=loss, grad_norm=model.grad_norm())
        optimizer.step()
        steps.append({"loss": loss, "ok": verdict.ok, "describe": verdict.describe()})
    state = {}
    for name, param in model.named_parameters().items():  # a collective per tensor: every rank, same order
        found = optimizer.state[param]
        state[name] = {key: _whole(found[key]).detach() for key in ("exp_avg", "exp_avg_sq")}
    report = {"steps": steps, "offloaded": _offloaded(model), "state": {}}
    if parity.reference is not None:
        reference = parity.reference
        named = dict(reference.model.named_parameters())
        for name, moments in state.items():
            expected = reference.optimizer.state[named[name]]
            report["state"][name] = {
                key: float((got - expected[key]).norm() - 1e-3 * expected[key].norm() - 1e-8)
                for key, got in moments.items()
            }
        Path(out).write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
