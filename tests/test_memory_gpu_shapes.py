"""The memory estimate of a published-size configuration, its parts pinned by hand (issue 32, item 5)."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import load_cluster
from cost_models.units import GIB
from planner.api import plan_prepared, prepare_model_file
from planner.baselines.data_parallel import data_parallel_stage
from planner.costing.zero import fsdp_memory
from planner.errors import AutoplanError
from tests.conftest import EXAMPLES

MPT_350M = {"size": "350m", "seq": 2048, "vocab": 50368}  # 24 layers, d_model 1024, 16 heads (MosaicML MPT-350M)


def test_mpt_350m_shaped_gpt_under_fsdp_at_micro_batch_32_needs_its_loss_not_unsharded_state() -> None:
    """examples/gpt.py at MPT-350M's shape, micro-batch 32 (batch 256 on 8 A100 80GB), seq 2048, FSDP (ZeRO-3), no
    recomputation, adam-mixed. Per device (s·b = 65,536 tokens, h = 1024, V = 50,368, bf16 activations):

    * state: 407.6M parameters × (2 B weights + 12 B Adam state) / 8 shards = 0.66 GiB (the 2 B gradients / 8 are
      made in the backward, on the timeline);
    * kept between forward and backward: 386 activation tensors of s·b·h elements at 2 B (per layer q, k, v, the
      two norms' and the two residuals' outputs, the attention output, fc and GELU outputs of 4h: 16, ×24, plus the
      final norm's), 48.25 GiB, and the logits the runner holds, s·b·V at 2 B: 6.15 GiB;
    * the loss at its peak: gpt.py's ``F.cross_entropy`` keeps the float32 log-softmax of every logit and makes two
      float32 gradients as large (autocast runs the loss in float32): 12 B × s·b·V = 36.9 GiB.

    91.9 GiB: over the 72.6 GiB budget, refused on what FSDP holds. Before, the data-parallel method refused it on
    the plain DDP figure (unsharded state) before ZeRO was applied; MPT's run fitted in 80 GB with a fused
    cross-entropy that never materialises the float32 log-softmax (its loss without those 36.9 GiB: ~55 GiB)."""
    cluster = load_cluster("dgx-a100", num_nodes=1)
    prepared = prepare_model_file(
        EXAMPLES / "gpt.py", cluster, batch_size=256, model_args=MPT_350M, remat="off", zero="3", microbatches=1
    )
    graph, setup = prepared.graphs.at(256), prepared.setup
    tokens, hidden, vocab = 32 * 2048, 1024, 50368
    stage = dataclasses.replace(data_parallel_stage(graph, setup, batch_size=256, devices=tuple(range(8))), zero=3)
    memory = fsdp_memory(stage, graph, setup)
    assert memory.state_bytes == pytest.approx(graph.num_params * 14 / 8)
    assert memory.kept_bytes == pytest.approx(386 * tokens * hidden * 2 + tokens * vocab * 2, rel=1e-3)
    assert setup.loss_bytes_per_output_element == pytest.approx(12.0, rel=1e-3)
    loss = 12 * tokens * vocab
    assert memory.peak_bytes == pytest.approx(memory.kept_bytes + loss, rel=1e-3)  # the peak is the loss's
    assert memory.total_bytes / GIB == pytest.approx(91.9, abs=0.05)
    with pytest.raises(
        AutoplanError,
        match=r"ZeRO-3, no recomputation, 1 microbatches needs 91\.9 GiB per device \(state [\d.]+ GiB \+ activations "
        r"[\d.]+ GiB\), the budget is 72\.6",
    ):
        plan_prepared(prepared, "data-parallel")
