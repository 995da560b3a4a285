"""A plan's memory per device: one number for the estimate, the simulator and ``plan show``."""

from __future__ import annotations

import pytest

from cost_models.cluster import load_cluster
from cost_models.loss_memory import DEFAULT_BYTES_PER_OUTPUT_ELEMENT
from planner.api import plan_model_file
from planner.costing.lowering import simulate_plan
from planner.costing.setup import plan_setup
from planner.plan import Plan
from tests.conftest import EXAMPLES, captured

GPT = {"size": "tiny", "attention": "unfused"}


def test_a_plan_keeps_the_loss_figure_it_was_priced_with_and_the_replay_charges_the_estimated_memory() -> None:
    """The search measures the model file's loss (GPT's cross entropy: its log-softmax and two logit-sized
    gradients, about 12 bytes per logit, not the mean's 4); the plan stores the figure, so the simulator and
    ``plan show`` charge the last stage's loss as the estimate did and the simulated peak is the estimate's."""
    cluster = load_cluster("dgx-a100", num_nodes=1, devices_per_node=2)
    plan = plan_model_file(
        EXAMPLES / "gpt.py",
        cluster,
        batch_size=8,
        model_args=GPT,
        method="megatron",
        degrees=(1, 2, 1),
        microbatches=4,
        schedule="1f1b",
    )
    assert len(plan.stages) == 2 and plan.num_microbatches == 4 and plan.schedule == "1f1b"
    setup = plan_setup(plan)
    simulated = simulate_plan(plan, captured("gpt", 2, **GPT), setup)
    assert simulated.max_memory_bytes == pytest.approx(plan.estimate.memory_per_device_bytes, rel=1e-6)
    assert setup.loss_bytes_per_output_element == plan.loss_bytes_per_output_element
    assert plan.loss_bytes_per_output_element > 2 * DEFAULT_BYTES_PER_OUTPUT_ELEMENT
    assert Plan.from_json(plan.to_json()).loss_bytes_per_output_element == plan.loss_bytes_per_output_element
