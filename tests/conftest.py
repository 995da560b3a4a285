"""Shared fixtures: example model files captured on the meta device."""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from pathlib import Path

import pytest
import torch

from planner.costing.records import record_of
from planner.costing.setup import plan_setup
from planner.costing.stage_work import stage_context
from planner.ir.capture import capture
from planner.ir.graph import OpGraph
from planner.ir.model_file import instantiate, load_model_file
from planner.plan import Plan
from planner.sharding.op_rules import enumerate_strategies

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Tests never read or write the user's profile or calibration cache, and `plan --cluster local-cpu` plans with the
# preset's figures unless a test asks for the default calibration (tests/test_calibrated_default.py).
os.environ["AUTOPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoplan-test-cache-")
os.environ["AUTOPLAN_CALIBRATE"] = "0"


@functools.cache
def captured(name: str, batch_size: int = 4, tracer: str = "export", **model_args: object) -> OpGraph:
    """The OpGraph of ``examples/<name>.py`` (built on meta), cached across tests."""
    model_file = load_model_file(EXAMPLES / f"{name}.py")
    model, inputs = instantiate(model_file, batch_size=batch_size, model_args=dict(model_args))
    return capture(model, inputs, tracer=tracer)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def edit_strategy(plan: Plan, graph: OpGraph, *, stage: int, node: str, output_spec: tuple[str, ...]) -> Plan:
    """``plan`` with one node's stored strategy replaced by the node's first strategy (its sharding rules)
    with ``output_spec``; ``graph`` at the plan's microbatch size."""
    edited = plan.stages[stage]
    context = stage_context(edited, graph, plan_setup(plan))
    local = context.graph.node(node)
    chosen = next(s for s in enumerate_strategies(local, context)[0] if s.output.placements == output_spec)
    strategies = {**edited.strategies, node: record_of(local, chosen)}
    stages = list(plan.stages)
    stages[stage] = dataclasses.replace(edited, strategies=strategies, explanation=())
    return dataclasses.replace(plan, stages=tuple(stages))


@pytest.fixture(scope="session")
def gpt_placement_problem():
    """GPT-350M (batch 8, 4 microbatches of 2) on one p3.16xlarge node, in 256 groups: the RL's problem."""
    from cost_models.cluster import load_cluster
    from cost_models.compute import RooflineCompute
    from planner.baselines.placement.problem import placement_problem
    from planner.baselines.placement.rl import group_ops, group_problem
    from planner.costing.setup import CostSetup

    cluster = load_cluster("p3.16xlarge", num_nodes=1, devices_per_node=8)
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")
    problem = placement_problem(captured("gpt", batch_size=2, size="350m"), setup, num_microbatches=4)
    return group_problem(problem, group_ops(problem, 256))
