"""Search seconds of ``method="auto"`` for GPT 350m … 39b on 1 … 64 GPUs, and the plans it finds.

Each case runs ``planner.api.plan_model_file`` in a fresh process (so model build, export and
imports are counted as a user sees them) and reports: capture (both exports and the build),
intra-op (layer tables), stage DP (with the hand-written grid), pricing, end to end; the
number of layer problems; the plan (stages, microbatches, step time, MFU) and, beside it, the
best data-parallel, Megatron ``(t, p, d)`` and uniform-pipeline plans under the same cost
model. Target (issue 4): GPT 39b on 64 GPUs in at most 60 s end to end on this machine.
With ``--save`` it also draws search seconds against model size, one line per cluster and GPU
count (:func:`draw`); ``--draw-from FILE.md`` redraws that figure from a saved table.

    python benchmarks/search_time.py [--sizes 350m,39b] [--clusters dgx-a100] [--devices 8,64]
                                     [--batch-size 256] [--save]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from results_page import RESULTS, save_table  # noqa: E402

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
    command = [sys.executable, __file__, "--worker", f"{size},{cluster},{devices}", "--batch-size", str(batch_size)]
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
            lines.append(f"| {r['size']} | {r['cluster']} | {r['devices']} | | | | | **{r['total_s']:.1f}** | | | "
                         f"{r['error']} | | | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['size']} | {r['cluster']} | {r['devices']} | {r['capture_s']:.1f} | {r['ilp_s']:.1f} | "
            f"{r['dp_s']:.1f} | {r['price_s']:.1f} | **{r['total_s']:.1f}** | {r['solves']} | {r['stages']} | "
            f"{r['meshes']} | {r['microbatches']} | {r['step_s']:.3g} | {r['mfu']:.0%} | {_other(r, 'data-parallel')} | "
            f"{_other(r, 'megatron')} | {_other(r, 'uniform-pipeline')} |"
        )
    return "\n".join(lines)


PARAMS_B = {"350m": 0.35, "1.3b": 1.3, "6.7b": 6.7, "39b": 39.0}


def draw(rows: list[dict], path: Path) -> None:
    """End-to-end search seconds against GPT size (log scale), one line per cluster × GPU count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cost_models.atomic_file import save_figure_atomic

    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for cluster in dict.fromkeys(r["cluster"] for r in rows):
        for devices in sorted({r["devices"] for r in rows if r["cluster"] == cluster}):
            found = [r for r in rows if r["cluster"] == cluster and r["devices"] == devices and "error" not in r]
            if found:
                sizes = [PARAMS_B.get(r["size"], float("nan")) for r in found]
                axis.plot(sizes, [r["total_s"] for r in found], marker="o", label=f"{cluster}, {devices} GPUs")
    axis.axhline(60, color="grey", linestyle="--", label="target: 60 s")
    axis.set(xscale="log", xlabel="GPT parameters (billions)", ylabel="auto search, end to end (s)",
             title="Search time against model size (plans that fit)")  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--devices", default=",".join(map(str, DEVICES)))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--save", action="store_true", help="write the table and figure to benchmarks/results/")
    parser.add_argument("--draw-from", type=Path, metavar="FILE.md", help="only redraw the figure of a saved table")
    options = parser.parse_args()
    if options.draw_from:
        figure = options.draw_from.with_suffix(".png")
        draw(rows_from_table(options.draw_from), figure)
        print(f"wrote {figure}")
        return
    sys.path.insert(0, str(ROOT))
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
        command = "python benchmarks/search_time.py " + " ".join(sys.argv[1:])
        description = (
            f'GPT (seq 1024) at global batch {options.batch_size}, `method="auto"`, roofline costs, adam-mixed. '
            "Times are seconds of wall clock on this machine; *total* is the whole process (imports, model build on "
            "meta, two exports, search). Step times of the hand-written plans are exact prices under the same model."
        )
        save_table("search_time", title="Auto-plan search time", command=command, description=description, table=text)
        draw(rows, RESULTS / f"search_time-{time.strftime('%Y-%m-%d')}.png")


if __name__ == "__main__":
    main()
