"""The gathered gradient syncs, DGC and DGA run as DDP's communication hook give, on every rank, what their papers
define.

``tests/compressed_sync_worker.py`` on two gloo ranks: per kind (top-k, 1-bit, threshold, TernGrad, QSGD, signSGD),
two exact warm-up steps then one compressed step, each gradient compared by relative norm with a reconstruction by
hand (every rank's local gradient compressed with its generator, decoded and averaged; signSGD's vote); DGC
(momentum correction, masking, sparsity warm-up) and DGA (the delayed average and its correction) over five
steps. The packing and the byte layout are tested in ``tests/test_compressors.py``; training under each kind in
``tests/test_lossy_sync.py``.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import torchrun

TOLERANCE = 1e-5  # the same float32 arithmetic on both sides, but sums in another order


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_each_gathered_sync_gives_the_mean_of_the_decoded_payloads(world: int, tmp_path) -> None:
    out = tmp_path / "report.json"
    done = torchrun(world, "compressed_sync_worker.py", out, [])
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert len(report) == 8
    for kind, steps in report.items():
        assert set(steps) == {f"step{k}" for k in range(5 if kind.startswith("dg") else 3)}, kind
        for step, errors in steps.items():
            assert errors, (kind, step)
            worst = max(errors.values())
            assert worst <= TOLERANCE, f"{kind} {step}: relative error {worst:.2e} ({errors})"
