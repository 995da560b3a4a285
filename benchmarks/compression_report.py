"""The page and figure of ``benchmarks/compression_accuracy.py``: a table per model and world, and the seeds' findings
checked on these runs (each said reproduced or not, with its numbers)."""

from __future__ import annotations

import math
from pathlib import Path

TAIL = 30  # steps of the training-loss mean reported ("last train loss")


def _quality(row: dict) -> str:
    if "accuracy" in row:
        return f"{100 * row['accuracy']:.1f}%"
    return f"{row['perplexity']:.2f}"


def _better(a: dict, b: dict) -> bool:
    """``a`` is better than ``b`` on held-out data (accuracy up, perplexity down)."""
    if "accuracy" in a:
        return a["accuracy"] > b["accuracy"]
    return a["perplexity"] < b["perplexity"]


def _table(case: str, rows: dict[str, dict]) -> list[str]:
    metric = "held-out accuracy" if "accuracy" in next(iter(rows.values())) else "held-out perplexity"
    exact_bytes = rows["exact"]["bytes_per_step"]
    lines = [
        f"### {case.replace('@', ' at world ')}",
        "",
        f"| method | {metric} | test loss | last {TAIL}-step train loss | bytes/step per rank | ratio | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, row in rows.items():
        sent = row["bytes_per_step"]
        size = "—" if sent is None else f"{sent:,.0f}"
        ratio = "—" if sent is None else f"{exact_bytes / sent:,.1f}×"
        tail = sum(row["losses"][-TAIL:]) / len(row["losses"][-TAIL:])
        lines.append(
            f"| {method} | {_quality(row)} | {row['test_loss']:.4f} | {tail:.4f} | {size} | {ratio} | "
            f"{row['wall_s']:.1f} |"
        )
    return [*lines, ""]


def _findings(results: dict[str, dict[str, dict]]) -> list[str]:
    lines = ["## The seeds' findings on these runs", ""]
    for case, rows in results.items():
        name = case.replace("@", " at world ")
        topk, dgc, exact = rows["topk:0.01"], rows["dgc:0.01"], rows["exact"]
        verdict = "reproduced" if _better(dgc, topk) else "NOT reproduced"
        lines.append(
            f"- {name}: top-k 0.01 {_quality(topk)}, DGC 0.01 {_quality(dgc)}, exact {_quality(exact)} — "
            f"DGC recovers what top-k loses: {verdict}."
        )
        lines += _dga_lines(rows)
        lines += _ps_lines(rows)
    lines += [
        "- TernGrad's unbiasedness is a property of its quantizer, checked over random gradients in "
        "`tests/test_compressors.py` (`test_stochastic_quantizers_are_unbiased`), not from these curves.",
        "",
    ]
    return lines


def _ps_lines(rows: dict[str, dict]) -> list[str]:
    """The synchronous parameter server against exact sync (the same update, summed in another order), and what
    staleness costs."""
    if "ps:2" not in rows:
        return []
    exact, sync = rows["exact"], rows["ps:2"]
    same = (
        "every loss identical to exact's"
        if sync["losses"] == exact["losses"]
        else "drifted from exact's losses: the same update summed in another order"
    )
    stale = ", ".join(
        f"K = {method.rsplit(':', 1)[1]} {'diverged' if _diverged(rows[method]) else _quality(rows[method])}"
        for method in rows
        if method.startswith("ps:2:")
    )
    return [
        f"  Parameter server: synchronous {_quality(sync)} ({same}), stale {stale}.",
    ]


def _diverged(row: dict) -> bool:
    return not math.isfinite(row["test_loss"]) or ("accuracy" in row and row["accuracy"] < 0.2)


def _dga_lines(rows: dict[str, dict]) -> list[str]:
    """DGA with its correction against without, per delay: who is better, and whether the gap grows with D."""
    lines, gaps = [], []
    for delay in (2, 8):
        with_c, without = rows[f"dga:{delay}"], rows[f"dga:{delay}@no-correction"]
        state = "diverged" if _diverged(without) else f"test loss {without['test_loss']:.4f}"
        lines.append(
            f"  DGA D = {delay}: with the correction {_quality(with_c)} (test loss {with_c['test_loss']:.4f}), "
            f"without {_quality(without)} ({state})."
        )
        gaps.append(math.inf if _diverged(without) else without["test_loss"] - with_c["test_loss"])
    better = all(gap > 0 for gap in gaps)
    lines.append(
        f"  With the correction better than without at every D: {'reproduced' if better else 'NOT reproduced'}."
    )
    if all(math.isinf(gap) for gap in gaps):
        grows = "not measurable here: without the correction the run diverged at both delays"
    else:
        grows = "reproduced" if gaps[1] > gaps[0] else "NOT reproduced"
    return [*lines, f"  The correction's advantage grows with D: {grows}."]


def render_page(results: dict[str, dict[str, dict]], meta: dict) -> str:
    lines = [
        f"# Gradient syncs on real data — {meta['date']}",
        "",
        f"Machine: {meta['machine']}. Command: `{meta['command']}` ({meta['steps']} steps per run). "
        "Every run is listed; one attempt each (nothing re-run or dropped). Data, models, optimizer, bytes: "
        "`benchmarks/compression_accuracy.py`'s docstring.",
        "",
        *(
            f"Rows added later ({added['date']}, {added['machine']}; its exact runs reproduced the losses above "
            f"exactly): `{added['command']}`.\n"
            for added in meta.get("added", [])
        ),
    ]
    for case, rows in results.items():
        lines += _table(case, rows)
    return "\n".join(lines + _findings(results))


def save_figure(results: dict[str, dict[str, dict]], path: Path) -> None:
    """Training-loss curves (moving mean over 20 steps), one panel per model and world; the axis stops at 3× the
    exact run's largest loss (a diverged run leaves the panel at the top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results)
    columns = 2
    rows = math.ceil(len(cases) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.5 * rows), squeeze=False)
    for axis, case in zip(axes.flat, cases, strict=False):
        for method, row in results[case].items():
            losses = row["losses"]
            smooth = [
                sum(losses[max(0, k - 19) : k + 1]) / len(losses[max(0, k - 19) : k + 1]) for k in range(len(losses))
            ]
            style = "-" if method == "exact" else ("--" if "dga" in method else ":")
            axis.plot(smooth, style, linewidth=2 if method == "exact" else 1, label=method)
        axis.set_title(case.replace("@", " at world "))
        axis.set_xlabel("step")
        axis.set_ylabel("training loss (20-step mean)")
        axis.set_yscale("log")
        axis.set_ylim(top=3 * max(results[case]["exact"]["losses"]))  # a diverged run leaves the top of the panel
    axes.flat[0].legend(fontsize=7, loc="lower left", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
