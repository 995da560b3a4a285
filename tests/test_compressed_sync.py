"""The gathered gradient syncs, DGC and DGA run as DDP's communication hook give, on every rank, what their papers
define.

``tests/compressed_sync_worker.py`` on two gloo ranks: per kind (top-k, 1-bit, threshold, TernGrad, QSGD, signSGD),
two exact warm-up steps then one compressed step, each gradient compared by relative norm with a reconstruction by
hand (every rank's local gradient compressed with its generator, decoded and averaged; signSGD's vote); DGC
(momentum correction, masking, sparsity warm-up; and again with local gradient clipping, active at every compressed
step) and DGA (the delayed average and its correction) over five steps.
The packing and the byte layout are tested in ``tests/test_compressors.py``; training under each kind in
``tests/test_lossy_sync.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from executors.compressed_sync import local_clip_scale
from tests.conftest import torchrun

TOLERANCE = 1e-5  # the same float32 arithmetic on both sides, but sums in another order


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_each_gathered_sync_gives_the_mean_of_the_decoded_payloads(world: int, tmp_path) -> None:
    out = tmp_path / "report.json"
    done = torchrun(world, "compressed_sync_worker.py", out, [])
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    clip_factors = report.pop("clip factors")
    assert len(clip_factors) == 3 * world and max(clip_factors) < 0.9, clip_factors  # every rank, compressed step
    assert len(report) == 9
    for kind, steps in report.items():
        assert set(steps) == {f"step{k}" for k in range(5 if kind.startswith("dg") else 3)}, kind
        for step, errors in steps.items():
            assert errors, (kind, step)
            worst = max(errors.values())
            assert worst <= TOLERANCE, f"{kind} {step}: relative error {worst:.2e} ({errors})"


def test_dgc_local_clipping_gives_a_bucket_its_share_of_the_node_threshold() -> None:
    """``c·√(numel_bucket / numel_model)·N^(−1/2)``: a bucket of 4 of 16 elements on 4 workers under ``c = 4`` is
    clipped to norm 1; no threshold or a norm under it leaves the gradient as it is."""
    bucket = [torch.full((3,), 1.0), torch.full((1,), 1.0)]  # norm 2
    clipped = local_clip_scale(bucket, max_grad_norm=4.0, model_numel=16, world=4)
    assert clipped == pytest.approx(1 / 2, rel=1e-5)
    assert local_clip_scale(bucket, max_grad_norm=None, model_numel=16, world=4) == 1.0
    assert local_clip_scale(bucket, max_grad_norm=40.0, model_numel=16, world=4) == 1.0
