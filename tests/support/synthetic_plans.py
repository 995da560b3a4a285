"""A hand-made plan for tests that read a plan's text and terms without planning one."""

from __future__ import annotations

from cost_models.cluster import Cluster, load_cluster
from planner.plan import Collective, Estimate, ModelRef, NodeSharding, Plan, SearchStats, Stage


def synthetic_plan(
    stages: list[Stage],
    *,
    m: int = 1,
    schedule: str = "none",
    cluster: Cluster | None = None,
    method: str = "auto",
    notes: tuple[str, ...] = (),
    mfu: float = 0.0,
) -> Plan:
    """A plan of ``stages`` whose step takes 1 s (report and Megatron-terms tests)."""
    estimate = Estimate(
        step_time_s=1.0,
        per_stage_time_s=(1.0,) * len(stages),
        memory_per_device_bytes=1 << 30,
        bubble_fraction=0.25,
        tflops_per_device=1.0,
        mfu=mfu,
    )
    return Plan(
        method=method,
        model=ModelRef(fingerprint="f", num_params=10),
        batch_size=64,
        num_microbatches=m,
        cluster=cluster or load_cluster("p3.16xlarge", num_nodes=8),
        schedule=schedule,
        optimizer="adam-mixed",
        stages=tuple(stages),
        estimate=estimate,
        search=SearchStats(time_s=1.0),
        notes=notes,
    )


def synthetic_stage(
    index: int,
    devices: range,
    mesh: tuple[int, ...],
    *,
    sharded: tuple[int, ...] = (),
    synced: tuple[int, ...] = (),
    remat: bool = False,
) -> Stage:
    """A stage of one operator reading parameter ``w`` (sharded along the ``sharded`` axes) and ``b``
    (replicated; its gradient synced over the ``synced`` axes)."""
    syncs = tuple(Collective(kind="all_reduce", axis=axis, phase="sync", operand=2) for axis in synced)
    record = NodeSharding(split="-", input_specs=(), output_spec=("R",) * len(mesh), collectives=syncs)
    placements = {
        "w": tuple("S(0)" if axis in sharded else "R" for axis in range(len(mesh))),
        "b": ("R",) * len(mesh),
    }
    return Stage(
        index=index,
        nodes=("linear",),
        devices=tuple(devices),
        mesh_shape=mesh,
        strategies={"linear": record},
        param_placements=placements,
        remat=remat,
    )
