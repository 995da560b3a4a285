"""``--check-parity`` for a training program: the same steps in one process on rank 0, compared each step.

:class:`ParityCheck` builds the user's own ``nn.Module`` on rank 0 with the same seed (same initial
weights), the same optimizer and learning-rate schedule (built by the program's own
``make_optimizer`` / ``make_lr_schedule``) and the same gradient clipping, and runs every step on
the whole global batch — gathered from the ranks that read it (:func:`executors.training.feed.global_batch_on_rank0`)
— under the run's precision, in chunks of the plan's batch-statistics rows. :meth:`ParityCheck.check`
compares the loss, the gradient norm before clipping and every gradient after clipping, by name,
within the precision's tolerance (:mod:`executors.parity`), then steps the reference's optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executors.parity import ParityResult, Reference, compare, gather_gradients
from executors.training.feed import global_batch_on_rank0
from executors.training.parallel_model import ParallelModel
from planner.errors import AutoplanError


class ParityCheck:
    def __init__(
        self,
        model: ParallelModel,
        *,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        make_lr_schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        self.model = model
        self.reference: Reference | None = None
        if not model.plan.grad_sync.same_update:
            raise AutoplanError(
                f"--check-parity compares every gradient with one process, which a lossy gradient sync "
                f"({model.plan.grad_sync.label}) cannot match: run without it (tests/test_lossy_sync.py compares "
                "the loss curves instead)"
            )
        if dist.get_rank() != 0:
            return
        workload, plan = model.workload, model.plan
        ref_model, _ = workload.build()
        # on the rank's device: the gathered batch is there, and autocast rounds as the ranks' kernels round
        ref_model = ref_model.to(workload.device)
        optimizer = make_optimizer(list(ref_model.parameters()))
        self.reference = Reference(
            ref_model,
            num_inputs=workload.num_inputs,
            loss_data=workload.loss_data,
            loss_fn=workload.loss_fn,
            optimizer=optimizer,
            scheduler=make_lr_schedule(optimizer) if make_lr_schedule else None,
            batch_size=plan.batch_size,
            precision=workload.precision,
            dropout=workload.dropout,
            chunks=plan.batch_size // plan.batch_stat_rows if plan.batch_stat_rows else 1,
            max_grad_norm=max_grad_norm,
        )

    def check(self, batch: Sequence[Any] | None, *, loss: float, grad_norm: float) -> ParityResult:
        """Compare this step (call after clipping, before the optimizer step); a collective over every rank."""
        info = self.model.rank_info()
        share = tuple(batch) if batch is not None and info.needs_data else None
        whole = global_batch_on_rank0(share, info)
        grads = gather_gradients(self.model.gradients())
        verdict: list[ParityResult | None] = [None]
        if self.reference is not None:
            assert whole is not None and grads is not None
            reference_loss, reference_grads, reference_norm = self.reference.step(whole)
            precision = self.model.precision
            verdict[0] = compare(
                loss,
                reference_loss,
                grads,
                reference_grads,
                rtol=precision.rtol,
                atol=precision.atol,
                norms=(grad_norm, reference_norm),
            )
            self.reference.update()
        dist.broadcast_object_list(verdict, src=0)
        assert verdict[0] is not None
        return verdict[0]
