"""The page of :mod:`benchmarks.quality`: per case, auto against the best hand-written plan, Alpa's space
and the placement baselines beside the physical bound (:func:`summary_table`), every method of every case
(:func:`detail_table`), the figure (:func:`draw`) and the saved page (:func:`save_page`), all read from the
results of ``python -m benchmarks.quality``'s per-case workers."""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

from benchmarks.quality_cases import ALPA, HANDWRITTEN, MODELS, PLACEMENT
from benchmarks.results_page import RESULTS, save_table
from cost_models.units import GIB
from planner.atomic_file import save_figure_atomic


def best_handwritten(result: dict) -> dict | None:
    fitting = [r for r in result["rows"] if r["method"] in HANDWRITTEN and r["fits"] and r["step_time_s"]]
    return min(fitting, key=lambda r: r["step_time_s"], default=None)


def auto_row(result: dict) -> dict | None:
    auto = next(r for r in result["rows"] if r["method"] == "auto")
    return auto if auto["fits"] and auto["step_time_s"] else None


def speedup(result: dict) -> float | None:
    auto, best = auto_row(result), best_handwritten(result)
    return best["step_time_s"] / auto["step_time_s"] if auto and best else None


def alpa_row(result: dict) -> dict | None:
    row = next((r for r in result["rows"] if r["method"] == ALPA), None)
    return row if row and row["fits"] and row["step_time_s"] else None


def speedup_over_alpa(result: dict) -> float | None:
    auto, alpa = auto_row(result), alpa_row(result)
    return alpa["step_time_s"] / auto["step_time_s"] if auto and alpa else None


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _s(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.4g}"


def summary_table(results: list[dict]) -> str:
    header = [
        "case",
        "GPUs",
        "batch",
        "bound s",
        "auto step s",
        "auto plan",
        "auto MFU",
        "auto GiB/dev",
        "auto search s",
        "best hand-written",
        "its step s",
        "its MFU",
        "**speedup**",
        "Alpa-space step s",
        "**over Alpa space**",
        "best placement",
        "auto ≤ all",
        "case s (CPU s)",
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * 4 + "---|" + "---:|" * 3 + "---|" + "---:|" * 5 + "---|---|---:|",
    ]
    for result in results:
        auto, best, bound = auto_row(result), best_handwritten(result), result["bound_s"]
        fitting = [r for r in result["rows"] if r["fits"] and r["step_time_s"] and r["method"] != "auto"]
        placed = min((r for r in fitting if r["method"] in PLACEMENT), key=lambda r: r["step_time_s"], default=None)
        ok = auto is not None and all(auto["step_time_s"] <= r["step_time_s"] * (1 + 1e-9) for r in fitting)
        gain = speedup(result)
        cells = [
            result["case"],
            str(result["devices"]),
            str(result["batch"]),
            f"{bound:.4g}",
            _s(auto and auto["step_time_s"]),
            auto["plan"] if auto else _no_plan(result, "auto"),
            f"{bound / auto['step_time_s']:.0%}" if auto else "—",
            f"{auto['memory_per_device_bytes'] / GIB:.2f}" if auto else "—",
            f"{auto['search_time_s']:.1f}" if auto else "—",
            best["method"] if best else "none fits",
            _s(best and best["step_time_s"]),
            f"{bound / best['step_time_s']:.0%}" if best else "—",
            f"**{gain:.3f}×**" if gain else "—",
            _s((alpa := alpa_row(result)) and alpa["step_time_s"]),
            f"**{over:.3f}×**" if (over := speedup_over_alpa(result)) else "—",
            f"{placed['method']} {placed['step_time_s'] / auto['step_time_s']:.2f}×" if placed and auto else "—",
            "yes" if ok else "**no**",
            f"{result['wall_s']:.0f} ({result['cpu_s']:.0f})",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _no_plan(result: dict, method: str) -> str:
    row = next(r for r in result["rows"] if r["method"] == method)
    return "no plan" if row["step_time_s"] is None else "does not fit"


def detail_table(results: list[dict]) -> str:
    header = ["case", "method", "step s", "× auto", "× bound", "MFU", "GiB/dev", "fits", "search s", "plan"]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * 5 + "---|---:|---|"]
    for result in results:
        auto, bound = auto_row(result), result["bound_s"]
        for row in result["rows"]:
            step = row["step_time_s"]
            ran = step is not None
            cells = [
                result["case"],
                row["method"] if row["method"] != "auto" else "**auto**",
                _s(step),
                f"{step / auto['step_time_s']:.2f}" if ran and auto else "—",
                f"{step / bound:.2f}" if ran else "—",
                f"{bound / step:.1%}" if ran else "—",
                f"{row['memory_per_device_bytes'] / GIB:.2f}" if ran else "—",
                ("yes" if row["fits"] else "no ✗") if ran else "no plan",
                f"{row['search_time_s']:.1f}",
                row["plan"],
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(results: list[dict], path: Path, *, title: str) -> None:
    """Per case: auto's and the best hand-written plan's simulated step ÷ the physical bound, and the speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    names = [r["case"] for r in results]
    x = range(len(results))
    auto = [(a["step_time_s"] / r["bound_s"]) if (a := auto_row(r)) else math.nan for r in results]
    hand = [(b["step_time_s"] / r["bound_s"]) if (b := best_handwritten(r)) else math.nan for r in results]
    gains = [speedup(r) or math.nan for r in results]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(max(8, 0.55 * len(results) + 2), 7.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    width = 0.38
    top.bar([i - width / 2 for i in x], hand, width, color="#a0aec0", label="best hand-written (DP, Megatron, uniform)")
    top.bar([i + width / 2 for i in x], auto, width, color="#2b6cb0", label="auto")
    top.axhline(1.0, color="black", linewidth=1.2, label="physical bound (FLOPs ÷ devices × peak)")
    top.set_yscale("log")
    top.set_ylabel("simulated step ÷ physical bound")
    top.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    top.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    top.tick_params(axis="y", which="minor", labelsize=7)
    fig.suptitle(title, fontsize=10)
    top.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    top.grid(axis="y", which="both", alpha=0.3)
    bottom.bar(list(x), gains, color="#2f855a")
    bottom.axhline(1.0, color="black", linewidth=1)
    valid = [g for g in gains if not math.isnan(g)]
    bottom.axhline(
        geomean(valid), color="#2f855a", linestyle="--", linewidth=1, label=f"geometric mean {geomean(valid):.3f}×"
    )
    bottom.set_ylabel("auto speedup over\nbest hand-written")
    bottom.set_ylim(min([0.95, *valid]), max([1.05, *valid]) * 1.05)
    bottom.legend(fontsize=8, loc="upper left")
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    fig.tight_layout()
    try:
        save_figure_atomic(fig, path)
    finally:
        plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def geomean_line(results: list[dict], gain_of, what: str) -> str:
    gains = {r["case"]: g for r in results if (g := gain_of(r))}
    values = list(gains.values())
    return (
        f"Geometric-mean speedup of auto over {what}: **{geomean(values):.3f}×** over {len(values)} case(s) "
        f"(min {min(values, default=math.nan):.3f}×, max {max(values, default=math.nan):.3f}×; "
        f"{sum(v < 1.15 for v in values)} below 1.15×: "
        + (", ".join(f"{case} {g:.3f}×" for case, g in gains.items() if g < 1.15) or "none")
        + ")."
    )


def save_page(results: list[dict], summary: str, footer: str, rl_budget_s: float) -> None:
    today = datetime.date.today().isoformat()
    figure = RESULTS / f"quality-{today}.png"
    RESULTS.mkdir(parents=True, exist_ok=True)
    draw(results, figure, title="auto vs the best hand-written plan vs the physical bound (simulated)")
    notes = "\n".join(
        f"- {result['case']} {row['method']}: {row['note']}"
        for result in results
        for row in result["rows"]
        if row["note"] and (row["method"] in ("auto", *HANDWRITTEN) or not row["fits"])
    )
    models = "; ".join(
        f"{name}: {example}.py {json.dumps(args)}, batch {batch}" for name, (example, args, batch) in MODELS.items()
    )
    description = (
        "Every method plans the same prepared model (`planner.compare.compare`, what `plan compare` runs) and every "
        "plan is replayed by the discrete-event simulator (`cost_models/simulator.py`): step times are simulated, "
        "memory is the simulated peak of the fullest device. Roofline costs, adam-mixed (bf16 compute), 8 GPUs per "
        f"node. Models (`--model-arg`s and global batch): {models}.\n\n"
        "*bound s* is the physical bound: model forward+backward FLOPs of one step ÷ (GPUs × peak bf16 FLOP/s); no "
        "plan can step faster. *MFU* = bound ÷ simulated step (model FLOPs only: recomputation is not counted). "
        "*Best hand-written* is the fastest plan that fits among data-parallel, megatron (best (t, p, d) grid "
        "point) and uniform-pipeline; *speedup* = its simulated step ÷ auto's. *Best placement* is the fastest "
        "device-placement baseline (hash, critical-path, multi-objective, m-etf, rl) as a multiple of auto's step. "
        "*auto ≤ all*: auto is at least as fast as every method whose plan fits. *auto search s* includes capture "
        "and cost setup; megatron and uniform-pipeline come out of the same search and report the same seconds. "
        f"RL trains for {rl_budget_s:g} s per case (every case, 64 GPUs included). *case s (CPU s)*: wall seconds of "
        "the case's process (all methods) and its CPU seconds; this machine's 2 cores were shared with other jobs, "
        "so wall (and search) seconds exceed what an idle machine takes.\n\n" + footer
    )
    tables = (
        summary + "\n\n![auto vs best hand-written vs bound](" + figure.name + ")\n\n"
        "## Every method, every case\n\n"
        "*× auto*: simulated step ÷ auto's; *× bound*: ÷ the physical bound; ✗: the simulated peak exceeds the "
        "device's memory (the step is shown but the plan is not counted); *plan*: stages×[meshes] and microbatches "
        "(placement baselines: devices holding operators).\n\n"
        + detail_table(results)
        + "\n\nNotes the comparison printed: every method with no plan or a plan that does not fit, and where the "
        "estimate of auto or a hand-written plan differs from the simulation by more than 10%, why:\n\n"
        + (notes or "- none")
    )
    command = "python -m benchmarks.quality " + " ".join(sys.argv[1:])
    save_table(
        "quality",
        title="Plan quality: auto against every baseline",
        command=command,
        description=description,
        table=tables,
    )
