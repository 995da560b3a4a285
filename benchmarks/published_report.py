"""The page of :mod:`benchmarks.published`: per published row, its measured throughput beside our
estimate of each model variant now and under earlier code (:func:`table`), auto's own plan beside it
(:func:`auto_table`), the counts within ±15% and ±10% (:func:`summary`) and the figure (:func:`draw`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.published_cases import AUTO_VARIANT, Row

BAND, MOONSHOT = 0.15, 0.10


def _ratio(run: dict | None, measured: float) -> float | None:
    if not run or "samples_s" not in run:
        return None
    return run["samples_s"] / measured


def _cell(value: float | None, digits: str = ".2f") -> str:
    return "" if value is None else format(value, digits)


def _marked(ratio: float | None) -> str:
    """The ratio, bold when outside ±15%."""
    if ratio is None:
        return "—"
    text = f"{ratio:.2f}"
    return text if abs(ratio - 1) <= BAND else f"**{text}**"


@dataclass(frozen=True, kw_only=True)
class Compared:
    """Runs of earlier code to show beside: label -> row name -> variant -> run."""

    columns: dict[str, dict[str, dict]]

    def ratio(self, label: str, row: Row, variant: str, measured: float) -> float | None:
        return _ratio(self.columns[label].get(row.name, {}).get(variant), measured)


def table(selected: list[Row], results: list[dict], compared: Compared, *, variant: str) -> str:
    """One row per published run: measured, our estimate of ``variant`` now and under the compared code."""
    labels = list(compared.columns)
    head = (
        "| row | GPUs | cluster | (t, p, d) | batch | runtime | measured TFLOP/s/GPU | measured samples/s | "
        "estimated samples/s "
    )
    head += "| **est ÷ measured** | " + "".join(f"{label} | " for label in labels) + "plan |"
    lines = [head, "|---|---:|---|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(labels) + "---|"]
    for row, entry in zip(selected, results, strict=True):
        if variant not in entry["runs"]:
            continue
        measured, run = entry["measured_samples_s"], entry["runs"][variant]
        estimated = _cell(run.get("samples_s"), ".1f")
        earlier = "".join(f"{_marked(compared.ratio(label, row, variant, measured))} | " for label in labels)
        name = f"{row.name} ({row.note})" if row.note else row.name
        lines.append(
            f"| {name} | {row.gpus} | {row.cluster} | {','.join(map(str, row.degrees))} | {row.batch} | "
            f"{run.get('runtime', row.runtime)} | {row.tflops_per_gpu:.1f} | {measured:.1f} | {estimated} | "
            f"{_marked(_ratio(run, measured))} | {earlier}{_shape(run, row)} |"
        )
    return "\n".join(lines)


def _shape(run: dict, row: Row) -> str:
    """The plan's shape, and the interleaving the row ran where the estimate runs 1F1B."""
    shape = run.get("shape", run.get("error", ""))
    return shape + (
        f" (ran interleaved, {row.virtual_stages} virtual stages per rank)" if row.virtual_stages > 1 else ""
    )


def auto_table(selected: list[Row], results: list[dict], *, variant: str) -> str:
    """``auto``'s plan (our runtime) beside the published configuration (``variant`` under its runtime), same
    model, cluster and batch; auto's MFU beside the best published for its GPU and model size."""
    from cost_models.mfu_bounds import published_bound

    lines = [
        "| row | published configuration: estimated samples/s | auto's plan | auto's estimate, samples/s | "
        "auto ÷ measured | auto ÷ published configuration (estimates) | auto's MFU | best published MFU "
        "(cost_models.mfu_bounds) | noted as above it |",
        "|---|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for row, entry in zip(selected, results, strict=True):
        fixed, auto = entry["runs"].get(variant, {}), entry.get("auto") or {"error": "not run"}
        rate = auto.get("samples_s")
        gain = rate / fixed["samples_s"] if rate and fixed.get("samples_s") else None
        bound = published_bound("A100" if row.cluster == "dgx-a100" else "V100", row.params_b * 1e9)
        best = f"{bound.mfu:.1%} ({bound.source})" if bound else ""
        mfu = _cell(auto.get("mfu"), ".1%")
        noted = "" if "mfu_note" not in auto else ("yes" if auto["mfu_note"] else "no")
        lines.append(
            f"| {row.name} | {_cell(fixed.get('samples_s'), '.1f')} | {auto.get('shape', auto.get('error', ''))} | "
            f"{_cell(rate, '.1f')} | {_cell(_ratio(auto, entry['measured_samples_s']))} | {_cell(gain)} | {mfu} | "
            f"{best} | {noted} |"
        )
    return "\n".join(lines)


def counts(ratios: list[float | None]) -> str:
    found = [r for r in ratios if r is not None]
    inside = sum(abs(r - 1) <= BAND for r in found)
    moon = sum(abs(r - 1) <= MOONSHOT for r in found)
    worst = max(found, key=lambda r: abs(r - 1)) if found else None
    return f"{inside} of {len(found)} rows within ±15%, {moon} within ±10%, worst {_cell(worst)}"


def summary(selected: list[Row], results: list[dict], compared: Compared, *, variants: list[str]) -> str:
    lines = []
    for variant in variants:
        shown = [(r, e) for r, e in zip(selected, results, strict=True) if variant in e["runs"]]
        now = [_ratio(e["runs"][variant], e["measured_samples_s"]) for _, e in shown]
        text = f"`{variant}`: estimated ÷ measured now: {counts(now)}"
        for label in compared.columns:
            old = [compared.ratio(label, r, variant, e["measured_samples_s"]) for r, e in shown]
            text += f"; {label}: {counts(old)}"
        lines.append(text + ".")
    return "\n".join(f"- {line}" for line in lines)


def draw(selected: list[Row], results: list[dict], compared: Compared, *, variants: list[str], path: Path) -> None:
    """Estimated ÷ measured per row (each variant now, the compared code, auto's estimate) with the ±15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.atomic_file import save_figure_atomic

    figure, axis = plt.subplots(figsize=(11, 4.6))
    xs = list(range(len(selected)))
    axis.axhspan(1 - BAND, 1 + BAND, color="tab:green", alpha=0.12, label="±15% (target)")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    measured = [e["measured_samples_s"] for e in results]
    series = []
    for variant, marker, hollow in zip(variants, "oD", "x+", strict=False):
        now = [_ratio(e["runs"].get(variant), m) for e, m in zip(results, measured, strict=True)]
        series.append((f"{variant}, now", now, marker, None))
        for label in compared.columns:
            ratios = [
                compared.ratio(label, r, variant, m) if y is not None else None
                for r, m, y in zip(selected, measured, now, strict=True)
            ]
            series.append((f"{variant}, {label}", ratios, hollow, None))
    auto = [_ratio(e.get("auto"), m) for e, m in zip(results, measured, strict=True)]
    series.append((f"auto's own plan ({AUTO_VARIANT}, our runtime)", auto, "s", "none"))
    for label, ratios, marker, face in series:
        points = [(x, y) for x, y in zip(xs, ratios, strict=True) if y is not None]
        if points:
            axis.scatter(
                *zip(*points, strict=True),
                marker=marker,
                label=label,
                facecolors=face,
                edgecolors="tab:purple" if face else None,
            )
    axis.set_xticks(xs, [row.name for row in selected], rotation=35, ha="right", fontsize=8)
    axis.set(ylabel="estimated ÷ measured throughput", title="Published Megatron-LM runs against our estimate")
    axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)
