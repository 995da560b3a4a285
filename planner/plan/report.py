"""Human-readable text about plans: the short summary ``plan`` and ``plan show`` print (``planner.api.summary``).

The summary opens with the plan's shape (:func:`planner.plan.shape.plan_shape`) and the same plan in
Megatron-LM's terms (:func:`planner.plan.megatron_terms.megatron_terms_text`: global batch, micro-batch
size per data-parallel replica, TP/PP/DP/VPP, sequence length, tokens/s per GPU, MFU), says what was
planned, the stages (graph nodes are *operators* here; *nodes* are the cluster's machines), the
estimate with its pipeline bubble (:func:`cost_models.simulator.bubble_fraction`), why the
method's candidate was chosen, in words, and ends with the next command to run.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from cost_models.cluster import PRESET_NAMES, Cluster, reserved_bytes
from cost_models.units import GIB
from planner.plan.choices import memory_saving_of
from planner.plan.grad_sync import GradSync
from planner.plan.launch import is_cpu_cluster, multi_node_note, torchrun_command
from planner.plan.megatron_terms import megatron_terms_text
from planner.plan.method import Method
from planner.plan.parts import Estimate, PlanView
from planner.plan.shape import count_of, plan_shape
from planner.plan.stage import Saving, Stage, stage_degrees

COMPARED_NOTE = "compared under the same cost model: "  # planner.api's note on the auto-family candidates
CHOSEN_MARK = "; chosen: "
# The candidates the auto search prices (planner.auto): their names in the note, and in words.
CANDIDATES: dict[str, tuple[str, str]] = {
    "stage-dp": (
        "stage-DP",
        "pipeline stages and their submeshes from Alpa's dynamic program, each stage's operators sharded by the "
        "intra-operator ILP",
    ),
    "megatron": (
        "Megatron",
        "a tensor × pipeline × data grid point (the best one, or --degrees) with equal layers per stage and Megatron "
        "tensor parallelism in each",
    ),
    "uniform-pipeline": (
        "uniform-pipeline",
        "equal layers per stage on equal submeshes, each stage sharded by the ILP",
    ),
    "data-parallel": ("data-parallel", "every device holds the whole model and a 1/D share of the batch"),
    "rescheduled": (
        "rescheduled",
        "one of the fastest pipelines re-cut into virtual stages (interleaved 1F1B) or with its backward passes split "
        "into input and weight gradients (zero bubble), priced by replaying the schedule",
    ),
}


def figures_text(cluster: Cluster) -> str:
    """Where the cluster's numbers come from: measured here (and corrected by ``plan tune``), or not."""
    calibration = cluster.calibration
    if calibration:
        corrections = calibration.get("corrections")
        tuned = f"; corrected by plan tune: {_corrections_text(corrections)}" if corrections else ""
        when = f" on {calibration['date']}" if calibration.get("date") else ""
        return f"calibrated: measured on this machine by {calibration.get('by', 'plan calibrate')}{when}{tuned}"
    if cluster.device.is_cpu():
        return "uncalibrated rough figures: run plan calibrate, or plan tune"
    if cluster.name in PRESET_NAMES:
        return "data-sheet figures, not measured: plan tune measures and corrects them"
    return "figures from the cluster file, not measured here"


def _corrections_text(corrections: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} ×{float(value):.3g}" for key, value in corrections.items())


def device_range(devices: tuple[int, ...]) -> str:
    if devices and list(devices) == list(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}..{devices[-1]}" if len(devices) > 1 else str(devices[0])
    return ",".join(str(d) for d in devices)


def _stage_line(stage: Stage) -> str:
    sharded = sum(any(p.startswith("S") for p in spec) for spec in stage.param_placements.values())
    params = f"{sharded} of {len(stage.param_placements)} parameters sharded" if sharded else "parameters replicated"
    mesh = "×".join(str(s) for s in stage.mesh_shape)
    line = (
        f"  stage {stage.index}: devices {device_range(stage.devices)}, {stage_degrees(stage).text()} (mesh {mesh}), "
        f"{count_of(len(stage.nodes), 'operator')}, {params}"
        + (
            ", sequence parallel (norms and dropouts split along the sequence)"
            if stage.uses_sequence_parallelism
            else ""
        )
    )
    saving = stage.memory_saving if memory_saving_of(stage) else None  # None: nothing to compare it with
    return line + (f"\n    memory: {memory_saving_text(saving)}" if saving else "")


def memory_saving_text(saving: Saving) -> str:
    """``selective recomputation (attention), ZeRO-1: 0.012 s and 1.2 GiB less than full recomputation, no ZeRO``."""
    seconds, size = saving.saved_s, saving.saved_bytes
    time_text = f"{abs(seconds):.3g} s {'less' if seconds >= 0 else 'more'}"
    bytes_text = f"{abs(size) / GIB:.3g} GiB {'less' if size >= 0 else 'more'}"
    return f"{saving.choice}: {time_text} per step and {bytes_text} per device than {saving.next_best}"


def _estimate_lines(plan: PlanView) -> list[str]:
    estimate, cluster = plan.estimate, plan.cluster
    return [
        f"estimate: step {estimate.step_time_s:.4g} s{breakdown_text(estimate)}",
        f"          {estimate.memory_per_device_bytes / GIB:.2f} GiB per device of a "
        f"{plan.memory_budget_bytes / GIB:.1f} "
        f"GiB budget ({headroom_text(plan)}), {estimate.tflops_per_device:.3g} TFLOP/s per device "
        f"({estimate.mfu:.0%} of peak), "
        f"{bubble_text(plan)}",
        f"          budget: {cluster.device.memory_bytes / GIB:.1f} GiB less "
        f"{reserved_bytes(cluster.device) / GIB:.1f} GiB "
        f"reserved for {_reserve_reason(cluster)}"
        + (f", × memory fraction {plan.memory_fraction:g}" if plan.memory_fraction != 1.0 else ""),
    ]


def _seconds_words(key: str) -> str:
    return key.removesuffix("_s").replace("_", " ")


def breakdown_text(estimate: Estimate) -> str:
    """`` = compute 0.011 s + grad sync 0.015 s + ... (hidden behind it: grad sync overlapped 0.002 s)``: the step's
    non-zero parts, which add up to it, and the work that runs behind them."""
    parts = " + ".join(f"{_seconds_words(key)} {value:.3g} s" for key, value in estimate.breakdown_s.items() if value)
    hidden = ", ".join(f"{_seconds_words(key)} {value:.3g} s" for key, value in estimate.hidden_s.items() if value)
    return (f" = {parts}" if parts else "") + (f" (hidden behind it: {hidden})" if hidden else "")


def headroom_bytes(plan: PlanView) -> float:
    """The budget less the estimate: what the fullest device has left (negative: over the budget)."""
    return plan.memory_budget_bytes - plan.estimate.memory_per_device_bytes


def headroom_text(plan: PlanView) -> str:
    """``12.30 GiB (17%) left on the fullest device``, or how far over the budget it is."""
    left, budget = headroom_bytes(plan), plan.memory_budget_bytes
    share = f" ({abs(left) / budget:.0%})" if budget > 0 else ""
    return (
        f"{left / GIB:.2f} GiB{share} left on the fullest device" if left >= 0 else f"{-left / GIB:.2f} GiB{share} over"
    )


def _reserve_reason(cluster: Cluster) -> str:
    if cluster.device.memory_reserve_bytes is not None:
        return "the runtime (the cluster file's memory_reserve_bytes)"
    if cluster.device.is_cpu():
        return "the interpreter and torch's libraries"
    return "the CUDA context, library workspaces, NCCL buffers and allocator fragmentation"


def bubble_text(plan: PlanView) -> str:
    """``pipeline bubble 12%``: the one bubble figure every command prints for a plan (its estimate's)."""
    return f"pipeline bubble {plan.estimate.bubble_fraction:.0%}"


def _search_line(plan: PlanView) -> str:
    search = plan.search
    return (
        f"search: {search.time_s:.2f} s (capture {search.capture_s:.2f} s, intra-op {search.ilp_s:.2f} s "
        f"in {search.ilp_solves} layer problems, stage DP {search.dp_s:.2f} s, pricing {search.price_s:.2f} s)"
    )


def _candidate_estimates(compared: str) -> str:
    """``stage-DP 0.119 s, Megatron 0.123 s`` from the note's ``stage-dp 0.119 s, megatron 0.123 s``."""
    entries = []
    for entry in compared.split(", "):
        name, _, seconds = entry.partition(" ")
        entries.append(f"{CANDIDATES.get(name, (name,))[0]} {seconds}")
    return ", ".join(entries)


def chosen_in_words(plan: PlanView, note: str) -> str | None:
    """The note ``compared under the same cost model: ...; chosen: X`` in words; None for any other note."""
    if not note.startswith(COMPARED_NOTE) or CHOSEN_MARK not in note:
        return None
    compared, chosen = note.removeprefix(COMPARED_NOTE).rsplit(CHOSEN_MARK, 1)
    label, what = CANDIDATES.get(chosen, (chosen, "a hand-written plan"))
    estimates = f"estimated steps of the candidates: {_candidate_estimates(compared)}"
    if plan.method == Method.AUTO:
        return (
            f"why this plan: auto chose the {label} candidate — {what} — the least estimated step of the "
            f"candidates (the data-parallel, Megatron and uniform-pipeline ones are those methods' own plans); "
            f"{estimates}"
        )
    return f"why this plan: --method {plan.method} takes the {label} candidate — {what}; {estimates}"


def _note_lines(plan: PlanView) -> list[str]:
    lines = []
    for note in plan.notes:
        words = chosen_in_words(plan, note)
        lines.append(words if words is not None else f"note: {note}")
    return lines


def next_step_lines(plan: PlanView, *, plan_path: str | None = None) -> list[str]:
    """What to run next: on this machine for a one-node CPU plan, else compile and launch with torchrun."""
    path = shlex.quote(plan_path) if plan_path else "PLAN.json"
    cluster = plan.cluster
    if is_cpu_cluster(cluster) and cluster.num_nodes == 1:
        check = (
            "   (trains here; a lossy gradient sync is not checked against one device)"
            if not plan.grad_sync.same_update
            else " --check-parity   (trains here, checked against one device)"
        )
        return [
            f"next: plan run {path} --steps 10{check}",
            f"      plan compile {path} --out train_dir   (writes train_dir/train.py for torchrun)",
        ]
    launch = torchrun_command(cluster, "train_dir/train.py")
    lines = [f"next: plan compile {path} --out train_dir, then on the cluster: {launch}"]
    note = multi_node_note(cluster)
    return [*lines, f"      ({note})"] if note else lines


def _sync_text(grad_sync: GradSync) -> str:
    """The header's gradient-sync clause: none for exact sync; a lossy one points at its note."""
    if not grad_sync.lossy:
        return ""
    return f", gradient sync {grad_sync.label}" + ("" if grad_sync.same_update else " (lossy: see its note)")


def _batch_text(plan: PlanView) -> str:
    """``batch 32 in 8 microbatches of 4 rows (over the replicas)``: a microbatch's rows across the data-parallel
    replicas; Megatron's micro-batch size (per replica) is on the Megatron-LM terms line."""
    m = plan.num_microbatches
    return f"batch {plan.batch_size}" + (
        f" in {m} microbatches of {plan.batch_size // m} rows (over the replicas)" if m > 1 else ""
    )


def plan_summary(
    plan: PlanView, *, plan_path: str | None = None, simulated_line: str | None = None, choices: str | None = None
) -> str:
    """A few lines: the plan's shape, what was planned, the stages, the estimate (and ``simulated_line``
    after it), why this plan, the search time, notes, ``choices`` (``plan show``: each stage's choices and savings,
    :mod:`planner.plan.choices`), and what to run next (on ``plan_path``)."""
    model, cluster = plan.model, plan.cluster
    args = ", ".join(f"{k}={v}" for k, v in model.args.items())
    lines = [
        plan_shape(plan),
        megatron_terms_text(plan.megatron, per="device" if cluster.device.is_cpu() else "GPU"),
        f"autoplan {plan.method} plan for {model.file or 'model'}{f' ({args})' if args else ''}: "
        f"{model.num_params / 1e6:,.1f}M parameters",
        f"cluster {cluster.name}: {count_of(cluster.num_nodes, 'node')} × {cluster.devices_per_node} "
        f"{cluster.device.name} ({figures_text(cluster)})",
        f"{_batch_text(plan)}, optimizer {plan.optimizer}" + _sync_text(plan.grad_sync),
        *(_stage_line(stage) for stage in plan.stages),
        *_estimate_lines(plan),
        *([simulated_line] if simulated_line else []),
        _search_line(plan),
        *_note_lines(plan),
        *([choices] if choices else []),
        *next_step_lines(plan, plan_path=plan_path),
    ]
    return "\n".join(lines)
