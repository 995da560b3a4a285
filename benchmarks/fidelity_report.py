"""The tables, text and figure of ``benchmarks/fidelity.py``'s results page.

Errors are ``(predicted − measured) / measured``; MAPE is the mean of their absolute values.
Memory: the measured peak of a rank is the CPU allocator's count of live bytes at its most during one step,
plus the parameters its runner trains in place (:mod:`executors.measure.memory_peak`); the
estimate's figure is the largest device's, the simulator's is per device (rank).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.fidelity_sets import SCORED, Attempt, Timing, probe_set, world_summary

MIB = 2**20
TARGETS = "Targets: per-world MAPE ≤ 15%, every row within ±30%, Spearman ≥ 0.9 within each world."
DESCRIPTION = (
    "Every world size is calibrated in the same run, just before its plans are made (raw machine figures, then "
    "the executors' host overheads and the compute contention fitted on the probe set below under the profiled "
    "cost model; the probes are timed twice and each keeps its least disturbed timing, the rule the scored "
    "plans' attempts follow); the scored plans are held out: no scored "
    "model is a probe model. Operator times are profiled in the same run (a fresh profile cache). Each scored "
    "plan runs with our executors over gloo, one thread per rank: median of the timed steps after 3 warm-up "
    "steps, slowest rank. *estimate*: the plan's estimate; *simulated*: the discrete-event replay; *roofline "
    "simulated*: the replay with the calibrated roofline instead of the operator profiles. " + TARGETS
)


def sets_text() -> str:
    probes = "; ".join(f"`{name}`: {text}" for name, text in probe_set().items())
    scored = "; ".join(
        f"`{name}`: examples/{case.model} "
        + " ".join(f"{k}={v}" for k, v in case.args.items())
        + f", batch {case.batch}, {case.method}"
        + (f" ({', '.join(f'{k} {v}' for k, v in case.options.items())})" if case.options else "")
        for name, case in SCORED.items()
    )
    return (
        f"**Probe set (fitted, never scored)**: {probes}.\n\n**Scored set (held out)**: {scored}. Degrees "
        "'tensor' = (world, 1, 1), 'pipeline' = (1, 2, world/2)."
    )


def calibration_text(calibrations: Mapping[int, Mapping]) -> str:
    lines = []
    for world, c in calibrations.items():
        runtime = ", ".join(
            f"{k} {v:.2f}" if k == "compute_extra" else f"{k} {v * 1e6:.1f} µs" for k, v in c["runtime"].items()
        )
        probes = ", ".join(f"{n} {m * 1e3:.1f}/{p * 1e3:.1f}" for n, m, p in c["probes"])
        lines.append(
            f"- world {world}: {c['peak_gflops']:.1f} GFLOP/s, {c['memory_gbs']:.2f} GB/s, shared slowdown "
            f"{c['shared_slowdown']:.2f}, link latency {c['latency_us']:.0f} µs, bandwidth {c['bandwidth_gbs']:.2f} "
            f"GB/s; fitted {runtime}; probes measured/fitted ms: {probes}"
        )
    return "Calibration of this run:\n\n" + "\n".join(lines)


def _by_world(rows: Mapping[str, Mapping]) -> dict[int, dict[str, Mapping]]:
    worlds: dict[int, dict[str, Mapping]] = {}
    for key, row in rows.items():
        worlds.setdefault(row["world"], {})[key] = row
    return worlds


def summary_table(rows: Mapping[str, Mapping]) -> str:
    lines = [
        "| world | predictor | rows | MAPE | worst row | within 20% | within 30% | Spearman |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, picked in sorted(_by_world(rows).items()):
        measured = {k: r["measured_s"] for k, r in picked.items()}
        for field, title in (("estimate_s", "estimate"), ("simulated_s", "simulated")):
            s = world_summary(world, {k: r[field] for k, r in picked.items()}, measured)
            lines.append(
                f"| {world} | {title} | {s.rows} | {s.mape:.0%} | {s.worst_key} {s.worst_error:+.0%} | "
                f"{s.within_20}/{s.rows} | {s.within_30}/{s.rows} | {s.spearman:.2f} |"
            )
    return "Per world (kept attempt):\n\n" + "\n".join(lines)


def rows_table(rows: Mapping[str, Mapping]) -> str:
    columns = (("estimate_s", "estimate"), ("simulated_s", "simulated"), ("roofline_s", "roofline simulated"))
    lines = [
        "| plan | world | method | steal + other | measured ms | "
        + " | ".join(f"{t} ms | error" for _, t in columns)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(columns),
    ]
    for key, row in rows.items():
        cells = [f"{row[f] * 1e3:.1f} | {row[f] / row['measured_s'] - 1:+.0%}" for f, _ in columns]
        lines.append(
            f"| {key} | {row['world']} | {row['method']} | {row.get('disturbance', 0.0):.0%} | "
            f"{row['measured_s'] * 1e3:.1f} | " + " | ".join(cells) + " |"
        )
    return "Step time per plan:\n\n" + "\n".join(lines)


def attempts_table(attempts: Sequence[Attempt], kept: Mapping[str, Timing]) -> str:
    runs = "; ".join(
        f"world {a.world} attempt {a.index}: load {a.load_before:.2f} → {a.load_after:.2f}, {a.wall_s:.0f} s"
        for a in attempts
    )
    indices = sorted({a.index for a in attempts})
    lines = [
        "| plan | " + " | ".join(f"attempt {i}: ms (steal + other)" for i in indices) + " | kept |",
        "|---|" + "---|" * len(indices) + "---|",
    ]
    for key, timing in kept.items():
        world = int(key.split("@")[1])
        cells = []
        for index in indices:
            found = [a.timings[key] for a in attempts if a.world == world and a.index == index and key in a.timings]
            t = found[0] if found else None
            mark = "**" if t is timing else ""
            cells.append(
                f"{mark}{t.measured_s * 1e3:.1f} ({t.steal_share:.0%} + {t.foreign_share:.0%}){mark}" if t else "–"
            )
        lines.append(f"| {key} | " + " | ".join(cells) + f" | attempt {timing.attempt} |")
    return (
        "Every timing attempt (kept in bold, the others discarded). Keep rule, fixed before any comparison with the "
        "estimates and blind to the error: per plan, the attempt whose timed steps had the least share of all CPU "
        "time taken by the VM's host (steal) plus other processes on this machine (busy ticks less our ranks' own "
        f"CPU time); ties to the earlier attempt. Runs: {runs}.\n\n" + "\n".join(lines)
    )


def memory_table(rows: Mapping[str, Mapping]) -> str:
    lines = [
        "| plan | measured MiB per rank | estimate MiB | error (vs largest rank) | simulated MiB per rank | "
        "error (largest) | worst rank error |",
        "|---|---|---|---|---|---|---|",
    ]
    errors, sim_errors = [], []
    for key, row in rows.items():
        measured, simulated = row["measured_bytes"], row["simulated_bytes"]
        top = max(measured)
        error = row["estimate_bytes"] / top - 1
        sim_error = max(simulated) / top - 1
        ranks = [s / m - 1 for s, m in zip(simulated, measured, strict=False) if m > 0]
        worst = max(ranks, key=abs) if ranks else 0.0
        errors.append(abs(error))
        sim_errors.append(abs(sim_error))
        lines.append(
            f"| {key} | {', '.join(f'{b / MIB:.1f}' for b in measured)} | {row['estimate_bytes'] / MIB:.1f} | "
            f"{error:+.0%} | {', '.join(f'{b / MIB:.1f}' for b in simulated)} | {sim_error:+.0%} | {worst:+.0%} |"
        )
    mean = sum(errors) / max(len(errors), 1)
    sim_mean = sum(sim_errors) / max(len(sim_errors), 1)
    return (
        f"Peak memory per device (rank): measured over one profiled step (the CPU allocator's count of live bytes at "
        f"its most during the step, counted from when the rank builds its runner, plus the model's parameters the "
        f"runner trains in place: executors/measure/memory_peak.py). Mean absolute error: estimate {mean:.0%}, "
        f"simulator {sim_mean:.0%}. The estimate has no reserve in it (the reserve is taken off the capacity, not "
        f"added to the plan): state, the executor's buffers and one microbatch's activation timeline with the loss "
        f"(planner/costing/stage_memory.py).\n\n" + "\n".join(lines)
    )


def draw(rows: Mapping[str, Mapping], path: Path) -> None:
    """Estimate against measured step time, log-log, one colour per world; a memory panel beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    from planner.atomic_file import save_figure_atomic

    has_memory = all("measured_bytes" in r for r in rows.values())
    figure, axes = plt.subplots(1, 2 if has_memory else 1, figsize=(12 if has_memory else 6.5, 5.5), squeeze=False)
    colors = {2: "tab:blue", 4: "tab:orange"}
    panels = [("measured_s", "estimate_s", 1e3, "step (ms)")]
    if has_memory:
        panels.append(("measured_bytes", "estimate_bytes", 1 / MIB, "peak memory per device (MiB)"))
    for axis, (x_field, y_field, scale, unit) in zip(axes[0], panels, strict=True):
        values = []
        for world, picked in sorted(_by_world(rows).items()):
            xs = [(max(r[x_field]) if isinstance(r[x_field], list) else r[x_field]) * scale for r in picked.values()]
            ys = [r[y_field] * scale for r in picked.values()]
            values += xs + ys
            axis.scatter(xs, ys, color=colors.get(world, "tab:green"), label=f"{world} processes", zorder=3)
            for key, x, y in zip(picked, xs, ys, strict=True):
                axis.annotate(key.split("@")[0], (x, y), fontsize=7, xytext=(4, -3), textcoords="offset points")
        low, high = min(values) / 1.3, max(values) * 1.3
        axis.plot([low, high], [low, high], color="grey", linestyle="--", label="predicted = measured")
        axis.fill_between(
            [low, high], [0.8 * low, 0.8 * high], [1.2 * low, 1.2 * high], color="grey", alpha=0.15, label="±20%"
        )
        axis.set(
            xscale="log",
            yscale="log",
            xlim=(low, high),
            ylim=(low, high),
            xlabel=f"measured {unit}",
            ylabel=f"estimated {unit}",
        )
        ticks = [t for t in (5, 10, 20, 25, 50, 100, 200, 400, 800, 1600) if low <= t <= high]
        for scale_axis in (axis.xaxis, axis.yaxis):
            scale_axis.set_major_locator(FixedLocator(ticks))
            scale_axis.set_major_formatter(FormatStrFormatter("%g"))
            scale_axis.set_minor_formatter(NullFormatter())
        axis.legend(loc="upper left", fontsize=8)
    figure.suptitle(f"Held-out cost-model fidelity on this machine, {time.strftime('%Y-%m-%d')}")
    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)
