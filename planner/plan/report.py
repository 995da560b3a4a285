"""Human-readable text about plans: the short summary ``plan`` prints."""

from __future__ import annotations

from cost_models.units import GIB
from planner.plan import Plan, Stage


def _device_range(devices: tuple[int, ...]) -> str:
    if devices and list(devices) == list(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}..{devices[-1]}" if len(devices) > 1 else str(devices[0])
    return ",".join(str(d) for d in devices)


def _stage_line(stage: Stage) -> str:
    sharded = sum(any(p.startswith("S") for p in spec) for spec in stage.param_placements.values())
    params = f"{sharded} of {len(stage.param_placements)} parameters sharded" if sharded else "parameters replicated"
    mesh = "×".join(str(s) for s in stage.mesh_shape)
    return (
        f"  stage {stage.index}: devices {_device_range(stage.devices)}, mesh {mesh}, "
        f"{len(stage.nodes)} nodes, {params}{', activations recomputed' if stage.remat else ''}"
    )


def plan_summary(plan: Plan) -> str:
    """A few lines: what was planned, the stages, the estimate and the search time."""
    cluster = plan.cluster
    model = plan.model
    args = ", ".join(f"{k}={v}" for k, v in model.args.items())
    estimate = plan.estimate
    breakdown = ", ".join(
        f"{key.removesuffix('_s').replace('_', ' ')} {value:.3g} s" for key, value in estimate.breakdown_s.items()
    )
    lines = [
        f"autoplan {plan.method} plan for {model.file or 'model'}{f' ({args})' if args else ''}: "
        f"{model.num_params / 1e6:,.1f}M parameters",
        f"cluster {cluster.name}: {cluster.num_nodes} node(s) × {cluster.devices_per_node} {cluster.device.name}",
        f"batch {plan.batch_size}, {plan.num_microbatches} microbatch(es), schedule {plan.schedule}, "
        f"optimizer {plan.optimizer}",
        *(_stage_line(stage) for stage in plan.stages),
        f"estimate: step {estimate.step_time_s:.4g} s ({breakdown})",
        f"          {estimate.memory_per_device_bytes / GIB:.2f} GiB per device of {cluster.device.memory_bytes / GIB:.1f} GiB, "
        f"{estimate.tflops_per_device:.3g} TFLOP/s per device ({estimate.mfu:.0%} of peak), "
        f"bubble {estimate.bubble_fraction:.0%}",
        f"search: {plan.search.time_s:.2f} s (capture {plan.search.capture_s:.2f} s, intra-op {plan.search.ilp_s:.2f} s "
        f"in {plan.search.ilp_solves} layer problems, stage DP {plan.search.dp_s:.2f} s, "
        f"pricing {plan.search.price_s:.2f} s)",
    ]
    lines.extend(f"note: {note}" for note in plan.notes)
    return "\n".join(lines)
