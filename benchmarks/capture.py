"""Capture time and peak memory (RSS) of GPT 125m … 39b built on the meta device.

Each size runs in a fresh process so its peak RSS is its own. Prints a table and, with
``--save``, writes it to ``benchmarks/results/capture-<date>.md`` with the machine and the
command. Target (issue 2): GPT 39b captured under 2 GiB RSS.

    python -m benchmarks.capture [--batch-size 8] [--tracer export] [--sizes 125m,39b] [--save]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results_page import save_table

ROOT = Path(__file__).resolve().parent.parent

SIZES = ("125m", "350m", "760m", "1.3b", "2.6b", "6.7b", "15b", "39b")


def worker(size: str, batch_size: int, tracer: str) -> dict:
    started = time.perf_counter()
    import torch  # noqa: F401 - import time is reported separately

    from planner.ir.capture import capture
    from planner.ir.model_file import instantiate, load_model_file

    imported = time.perf_counter()
    model_file = load_model_file(ROOT / "examples" / "gpt.py")
    model, inputs = instantiate(model_file, batch_size=batch_size, model_args={"size": size})
    built = time.perf_counter()
    graph = capture(model, inputs, tracer=tracer)
    captured = time.perf_counter()
    return {
        "size": size,
        "params": graph.num_params,
        "nodes": len(graph),
        "import_s": imported - started,
        "build_s": built - imported,
        "capture_s": captured - built,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def run(size: str, batch_size: int, tracer: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.capture",
        "--worker",
        size,
        "--batch-size",
        str(batch_size),
        "--tracer",
        tracer,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = [
        "| size | parameters | operators | build s | capture s | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size']} | {row['params'] / 1e9:.2f} B | {row['nodes']} | {row['build_s']:.2f} | "
            f"{row['capture_s']:.2f} | {row['peak_rss_bytes'] / 2**20:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.capture", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tracer", default="export", choices=("export", "fx"))
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--save", action="store_true", help="write the table to benchmarks/results/")
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker, options.batch_size, options.tracer)))
        return
    rows = []
    for size in options.sizes.split(","):
        rows.append(run(size, options.batch_size, options.tracer))
        print(f"captured {size}", file=sys.stderr)
    text = table(rows)
    print(text)
    if options.save:
        save_table(
            "capture",
            title="Capture benchmark",
            command=f"python -m benchmarks.capture --batch-size {options.batch_size} --tracer {options.tracer} --save",
            description=f"GPT from `examples/gpt.py` built on the meta device, batch {options.batch_size}, sequence "
            "1024; each size in a fresh process (peak RSS includes importing torch).",
            table=text,
        )


if __name__ == "__main__":
    main()
