"""Search seconds of ``method="auto"`` for GPT 350m … 39b on 1 … 64 GPUs, and the plans it finds.

Each case runs ``planner.api.plan_model_file`` in a fresh process (so model build, export and
imports are counted as a user sees them) and reports: capture (both exports and the build),
intra-op (layer tables), stage DP (with the hand-written grid), pricing, end to end; the
number of layer problems; the plan (stages, microbatches, step time, MFU) and, beside it, the
best data-parallel, Megatron ``(t, p, d)`` and uniform-pipeline plans under the same cost
model. Target (issue 4): GPT 39b on 64 GPUs in at most 60 s end to end on this machine.
With ``--save`` it also draws search seconds against model size, one line per cluster and GPU
count (:func:`draw`); ``--draw-from FILE.md`` redraws that figure from a saved table.

    python -m benchmarks.search_time [--sizes 350m,39b] [--clusters dgx-a100] [--devices 8,64]
                                     [--batch-size 256] [--save]

``--scale`` runs the at-scale rows instead (:mod:`scale_cases`): every Megatron-LM SC'21 row (32 …
3072 A100s, GPT-1.7B … 1T) as published with ``--method megatron --degrees``, a Llama-3.1-405B
shape on 8192 H100s, and ``auto`` on GPT-39B/64 V100s and the Megatron rows of 1.7B, 7.5B, 39.1B,
145.6B and 1T (32 … 3072 A100s), each
in a fresh process with ``--jobs 2``: wall seconds, peak RSS, the breakdown (capture, layer
options, stage DP or grid scoring, pricing) and the plan. ``--cases gpt-1008b,llama-405b`` picks rows.

    python -m benchmarks.search_time --scale [--cases NAME,...] [--timeout-s 600] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results_page import RESULTS, save_table

ROOT = Path(__file__).resolve().parent.parent

SIZES = ("350m", "1.3b", "6.7b", "39b")
CLUSTERS = ("p3.16xlarge", "dgx-a100")
DEVICES = (1, 8, 16, 64)


def worker(size: str, cluster_name: str, num_devices: int, batch_size: int) -> dict:
    started = time.perf_counter()
    from cost_models.cluster import load_cluster
    from planner.api import plan_model_file
    from planner.errors import AutoplanError

    nodes, per_node = (1, num_devices) if num_devices < 8 else (num_devices // 8, 8)
    cluster = load_cluster(cluster_name, num_nodes=nodes, devices_per_node=per_node)
    row = {"size": size, "cluster": cluster_name, "devices": num_devices}
    try:
        plan = plan_model_file(ROOT / "examples" / "gpt.py", cluster, batch_size=batch_size, model_args={"size": size})
    except AutoplanError as error:
        return {**row, "error": str(error)[:80], "total_s": time.perf_counter() - started}
    search = plan.search
    compared = next((n for n in plan.notes if n.startswith("compared")), "")
    others = dict(re.findall(r"(data-parallel|megatron|uniform-pipeline) ([\d.e+-]+) s", compared))
    return {
        **row,
        "total_s": time.perf_counter() - started,
        "capture_s": search.capture_s,
        "ilp_s": search.ilp_s,
        "dp_s": search.dp_s,
        "price_s": search.price_s,
        "solves": search.ilp_solves,
        "stages": len(plan.stages),
        "meshes": " ".join("×".join(map(str, s.mesh_shape)) for s in plan.stages[:4])
        + (" …" if len(plan.stages) > 4 else ""),
        "microbatches": plan.num_microbatches,
        "step_s": plan.estimate.step_time_s,
        "mfu": plan.estimate.mfu,
        "others": {k: float(v) for k, v in others.items()},
    }


def run(size: str, cluster: str, devices: int, batch_size: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.search_time",
        "--worker",
        f"{size},{cluster},{devices}",
        "--batch-size",
        str(batch_size),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _other(row: dict, method: str) -> str:
    value = row["others"].get(method)
    return "—" if value is None else f"{value:.3g}"


def table(rows: list[dict]) -> str:
    lines = [
        "| GPT | cluster | GPUs | capture s | intra-op s | DP s | pricing s | **total s** | layer problems | stages | "
        "meshes | microbatches | step s | MFU | data-parallel s | Megatron s | uniform s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['size']} | {r['cluster']} | {r['devices']} | | | | | **{r['total_s']:.1f}** | | | "
                f"{r['error']} | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['size']} | {r['cluster']} | {r['devices']} | {r['capture_s']:.1f} | {r['ilp_s']:.1f} | "
            f"{r['dp_s']:.1f} | {r['price_s']:.1f} | **{r['total_s']:.1f}** | {r['solves']} | {r['stages']} | "
            f"{r['meshes']} | {r['microbatches']} | {r['step_s']:.3g} | {r['mfu']:.0%} | "
            f"{_other(r, 'data-parallel')} | "
            f"{_other(r, 'megatron')} | {_other(r, 'uniform-pipeline')} |"
        )
    return "\n".join(lines)


PARAMS_B = {"350m": 0.35, "1.3b": 1.3, "6.7b": 6.7, "39b": 39.0}


def draw(rows: list[dict], path: Path) -> None:
    """End-to-end search seconds against GPT size (log scale), one line per cluster × GPU count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.atomic_file import save_figure_atomic

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for cluster in dict.fromkeys(r["cluster"] for r in rows):
        for devices in sorted({r["devices"] for r in rows if r["cluster"] == cluster}):
            found = [r for r in rows if r["cluster"] == cluster and r["devices"] == devices and "error" not in r]
            if found:
                sizes = [PARAMS_B.get(r["size"], float("nan")) for r in found]
                axis.plot(sizes, [r["total_s"] for r in found], marker="o", label=f"{cluster}, {devices} GPUs")
    axis.axhline(60, color="grey", linestyle="--", label="target: 60 s")
    axis.set(
        xscale="log",
        xlabel="GPT parameters (billions)",
        ylabel="auto search, end to end (s)",
        title="Search time against model size (plans that fit)",
    )
    axis.legend(fontsize=7)
    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)


def rows_from_table(path: Path) -> list[dict]:
    """The rows of a table this script saved: size, cluster, GPUs, total seconds (errors marked)."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 8 or cells[0] not in PARAMS_B:
            continue
        row = {"size": cells[0], "cluster": cells[1], "devices": int(cells[2]), "total_s": float(cells[7].strip("*"))}
        rows.append(row if cells[3] else {**row, "error": "does not fit"})
    return rows


def scale_table(rows: list[dict]) -> str:
    lines = [
        "| model | method | degrees | GPUs | **wall s** | peak RSS GiB | capture s | layer options s | DP / grid s | "
        "pricing s | layer problems | plan | step s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        case = r["case"]
        degrees = ",".join(map(str, case.degrees)) if case.degrees else "searched"
        gpus = case.nodes * (4 if case.cluster == "local-cpu" else 8)
        head = f"| {case.name} | {case.method} | {degrees} | {gpus} | **{r['wall_s']:.1f}** |"
        if "error" in r:
            rss = f"{r['rss_gib']:.2f}" if "rss_gib" in r else ""
            lines.append(f"{head} {rss} | | | | | | {r['error']} | |")
            continue
        plan, search = r["plan"], r["plan"]["search"]
        shape = f"{len(plan['stages'])} stages, {plan['num_microbatches']} microbatches"
        lines.append(
            f"{head} {r['rss_gib']:.2f} | {search['capture_s']:.1f} | {search['ilp_s']:.1f} | {search['dp_s']:.2f} | "
            f"{search['price_s']:.2f} | {search['ilp_solves']} | {shape} | {plan['estimate']['step_time_s']:.4g} |"
        )
    return "\n".join(lines)


def run_scale(options: argparse.Namespace) -> None:
    import tempfile

    from benchmarks.scale_cases import auto_cases, megatron_cases, run_case

    cases = [*megatron_cases(), *auto_cases()]
    if options.cases:
        wanted = options.cases.split(",")
        cases = [case for case in cases if case.name in wanted or f"{case.name}:{case.method}" in wanted]
    rows, load_before = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        for case in cases:
            rows.append(run_case(case, timeout_s=options.timeout_s, scratch=Path(scratch)))
            print(scale_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    text = scale_table(rows)
    print(text)
    load = f"Load average (1 min) {load_before:.2f} before the first row, {os.getloadavg()[0]:.2f} after the last."
    print(load)
    if options.save:
        command = "python -m benchmarks.search_time " + " ".join(sys.argv[1:])
        description = (
            f"{load} "
            "Each row is `plan` in a fresh process with `--jobs 2` (the two exports overlap), roofline costs, "
            "adam-mixed; *wall* is the whole process (imports, model build on meta, exports, search, writing the "
            "plan); peak RSS is the largest process (the planner or its capture child). Megatron rows are the "
            "published (t, p, d) with full recomputation (`--remat on`), GPT seq 2048, vocab 51200."
        )
        save_table("search_time-scale", title="Planning at scale", command=command, description=description, table=text)
        draw_scale(rows, RESULTS / f"search_time-scale-{time.strftime('%Y-%m-%d')}.png")


def draw_scale(rows: list[dict], path: Path) -> None:
    """Wall seconds and peak RSS against GPUs, one marker per row, labelled by model; fixed and auto apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.atomic_file import save_figure_atomic

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, marker in (("megatron", "o"), ("auto", "s")):
        found = [r for r in rows if r["case"].method == method and "rss_gib" in r]
        gpus = [r["case"].nodes * 8 for r in found]
        left.scatter(gpus, [r["wall_s"] for r in found], marker=marker, label=f"{method}")
        right.scatter(gpus, [r["rss_gib"] for r in found], marker=marker, label=f"{method}")
        for r, x in zip(found, gpus, strict=True):
            left.annotate(r["case"].name, (x, r["wall_s"]), fontsize=6)
    left.axhline(10, color="grey", linestyle=":", label="fixed-configuration target 10 s")
    left.axhline(60, color="grey", linestyle="--", label="auto target 60 s")
    right.axhline(2, color="grey", linestyle="--", label="target 2 GiB")
    left.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="plan, end to end (s)", title="Search seconds")
    right.set(xscale="log", xlabel="GPUs", ylabel="peak RSS (GiB)", title="Peak memory of the planner")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.search_time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--devices", default=",".join(map(str, DEVICES)))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--save", action="store_true", help="write the table and figure to benchmarks/results/")
    parser.add_argument("--draw-from", type=Path, metavar="FILE.md", help="only redraw the figure of a saved table")
    parser.add_argument("--scale", action="store_true", help="the at-scale rows (see the module docstring)")
    parser.add_argument("--cases", default="", help="--scale: only these rows (names, or name:method)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="--scale: seconds per row before it is stopped")
    options = parser.parse_args()
    if options.scale:
        run_scale(options)
        return
    if options.draw_from:
        figure = options.draw_from.with_suffix(".png")
        draw(rows_from_table(options.draw_from), figure)
        print(f"wrote {figure}")
        return
    if options.worker:
        size, cluster, devices = options.worker.split(",")
        print(json.dumps(worker(size, cluster, int(devices), options.batch_size)))
        return
    rows = []
    for cluster in options.clusters.split(","):
        for size in options.sizes.split(","):
            for devices in map(int, options.devices.split(",")):
                rows.append(run(size, cluster, devices, options.batch_size))
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if options.save:
        command = "python -m benchmarks.search_time " + " ".join(sys.argv[1:])
        description = (
            f'GPT (seq 1024) at global batch {options.batch_size}, `method="auto"`, roofline costs, adam-mixed. '
            "Times are seconds of wall clock on this machine; *total* is the whole process (imports, model build on "
            "meta, two exports, search). Step times of the hand-written plans are exact prices under the same model."
        )
        save_table("search_time", title="Auto-plan search time", command=command, description=description, table=text)
        draw(rows, RESULTS / f"search_time-{time.strftime('%Y-%m-%d')}.png")


if __name__ == "__main__":
    main()
