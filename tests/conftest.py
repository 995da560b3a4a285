"""Shared fixtures and helpers: example model files captured on the meta device, the cost setups, meshes,
clusters and pipelines several test files build, and ``torchrun`` for the tests that launch ranks.

Test files import the helpers from here (``from tests.conftest import captured``), never from one another."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from cost_models.cluster import Cluster, DeviceSpec, Link, load_cluster
from cost_models.compute import RooflineCompute
from cost_models.units import GIB
from executors.training.launch import torchrun_argv
from planner.costing.lowered_tasks import Chunk, Lowered
from planner.costing.node_cost import grad_values
from planner.costing.records import record_of
from planner.costing.setup import CostSetup, plan_setup
from planner.costing.stage_work import stage_context
from planner.ir.capture import capture
from planner.ir.graph import OpGraph
from planner.ir.model_file import instantiate, load_model_file
from planner.plan import Plan
from planner.sharding.op_rules import enumerate_strategies
from planner.sharding.specs import StageMesh
from planner.sharding.strategies import NodeStrategy, StrategyContext

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# Tests never read or write the user's profile or calibration cache, and `plan --cluster local-cpu` plans with the
# preset's figures unless a test asks for the default calibration (tests/test_calibrated_default.py).
os.environ["AUTOPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoplan-test-cache-")
os.environ["AUTOPLAN_CALIBRATE"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the zoo's HF models are built from configs


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
    from planner.baselines.placement.problem import placement_problem
    from planner.baselines.placement.rl import group_ops, group_problem

    cluster = load_cluster("p3.16xlarge", num_nodes=1, devices_per_node=8)
    setup = CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")
    problem = placement_problem(captured("gpt", batch_size=2, size="350m"), setup, num_microbatches=4)
    return group_problem(problem, group_ops(problem, 256))


# One node of 8 devices linked at 1 GB/s, 10 µs: tests/test_strategies.py works its costs out by hand on it.
TOY_LINK = Link(bandwidth=1e9, latency_s=1e-5)
TOY_DEVICE = DeviceSpec(name="test", peak_flops={"float32": 1e12}, memory_bytes=2**34, memory_bandwidth=1e11)
TOY_CLUSTER = Cluster(
    name="test", num_nodes=1, devices_per_node=8, device=TOY_DEVICE, intra_node=TOY_LINK, inter_node=TOY_LINK
)


def context(
    graph: OpGraph, shape: tuple[int, ...], *, grad_itemsize: int = 4, grad: frozenset[str] | None = None
) -> StrategyContext:
    """The strategy context of ``graph`` on a mesh of ``shape`` over :data:`TOY_CLUSTER`."""
    mesh = StageMesh(cluster=TOY_CLUSTER, devices=tuple(range(math.prod(shape))), mesh_shape=shape)
    needs = grad_values(graph) if grad is None else grad
    return StrategyContext(graph=graph, mesh=mesh, grad_values=needs, grad_itemsize=grad_itemsize)


def by_name(graph: OpGraph, node: str, shape: tuple[int, ...], **options: object) -> dict[str, NodeStrategy]:
    """Every strategy of ``node`` on a mesh of ``shape``, by name (the names checked unique)."""
    strategies, reason = enumerate_strategies(graph.node(node), context(graph, shape, **options))
    assert reason is None, reason
    names = [s.name for s in strategies]
    assert len(names) == len(set(names)), f"duplicate strategies {names}"
    return {s.name: s for s in strategies}


A100 = load_cluster("dgx-a100")


def setup_for(memory_gib: float | None = None, cluster=A100) -> CostSetup:
    """A cost setup on ``cluster`` (mixed-precision Adam); with ``memory_gib`` per device and no reserve when given."""
    if memory_gib is not None:
        # the budget is memory_gib: no reserve (cost_models.cluster.reserved_bytes) on these test devices
        device = dataclasses.replace(cluster.device, memory_bytes=int(memory_gib * GIB), memory_reserve_bytes=0)
        cluster = dataclasses.replace(cluster, device=device)
    return CostSetup(cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed")


def mesh_for(setup: CostSetup, shape: tuple[int, ...]) -> StageMesh:
    """A mesh of ``shape`` over the first 8 devices of the setup's cluster."""
    return StageMesh(
        cluster=setup.cluster, devices=tuple(range(8)), mesh_shape=shape, activation_itemsize=setup.activation_itemsize
    )


# A custom cluster file (tests/test_cluster.py, tests/test_headroom.py): two nodes of four L4s.
LAB_CLUSTER_TOML = """
name = "lab"
num_nodes = 2
devices_per_node = 4
[device]
name = "L4"
peak_flops = { bfloat16 = 121e12, float32 = 30e12 }
memory_bytes = 24_000_000_000
memory_bandwidth = 300e9
[intra_node]
bandwidth = 32e9
latency_s = 10e-6
[inter_node]
bandwidth = 12.5e9
latency_s = 0
"""


def pipeline(fwd, bwd, *, m: int, schedule: str, transfer_s: float = 0.0, step_s: float = 0.0, act: float = 0.0):
    """A chain of single-device stages with the given per-microbatch forward and backward seconds."""
    count = len(fwd)
    return Lowered(
        num_devices=count,
        stage_devices=tuple((s,) for s in range(count)),
        state_bytes=(0.0,) * count,
        step_s=(step_s,) * count,
        chunks=tuple(Chunk(stage=s, fwd_s=fwd[s], bwd_s=bwd[s], activation_bytes=act) for s in range(count)),
        edges={(s, s + 1): 1.0 for s in range(count - 1)},
        grad_edges={(s, s + 1): 1.0 for s in range(count - 1)},
        schedule=schedule,
        num_microbatches=m,
        transfer_s=lambda a, b, n: transfer_s,
    )


def torchrun(world: int, worker: str, out: Path, plans: list[Path]) -> subprocess.CompletedProcess:
    """``tests/<worker>`` on ``world`` ranks under torchrun, with ``out`` and the plan files as its arguments."""
    command = torchrun_argv(world=world, program=ROOT / "tests" / worker, args=[out, *plans])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
