"""The at-scale rows of ``benchmarks/search_time.py --scale``: published Megatron-LM configurations
(SC'21 Table 1, ``../shared/published-measurements.md``: GPT, seq 2048, vocab 51200, dgx-a100,
full recomputation) evaluated as given, a Llama-3.1-405B-shaped model on 1024 dgx-h100 nodes, and
``auto`` on GPT-39B / 64 V100s and on five of the Megatron rows (32 … 3072 A100s), beside which
the table's Megatron row is the published configuration under the same cost model. Each case runs
``plan`` in a fresh process (imports, model build on meta, both exports, search, writing the plan) with
``--jobs 2``; wall seconds and the peak RSS of the planner and of its forked capture child come from the child's own
accounting.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (params B, heads, hidden, layers, t, p, GPUs, batch) — Narayanan et al. SC'21, Table 1
MEGATRON_ROWS = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512),
    (3.6, 32, 3072, 30, 2, 1, 64, 512),
    (7.5, 32, 4096, 36, 4, 1, 128, 512),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
)
LLAMA_405B = {
    "layers": 126,
    "hidden": 16384,
    "heads": 128,
    "kv_heads": 8,
    "intermediate": 53248,
    "vocab": 128256,
    "seq": 8192,
}


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    model: str  # path under the repository
    args: dict
    cluster: str
    nodes: int
    batch: int
    method: str
    degrees: tuple[int, int, int] | None = None
    remat: str = "auto"
    devices_per_node: int | None = None  # the preset's when None
    space: str = "full"  # "alpa": without what Megatron-LM lacked in 2019-2021 (SP, ZeRO, interleaving)
    microbatches: int | None = None  # the planner's choice when None
    runtime: str = "autoplan"  # the system the estimate describes (planner.costing.runtime_profiles)


def gpt_args(heads: int, hidden: int, layers: int) -> dict:
    return {"size": "39b", "layers": layers, "hidden": hidden, "heads": heads, "seq": 2048}


def megatron_cases() -> list[Case]:
    cases = []
    for params, heads, hidden, layers, t, p, gpus, batch in MEGATRON_ROWS:
        cases.append(
            Case(
                name=f"gpt-{params:g}b",
                model="examples/gpt.py",
                args=gpt_args(heads, hidden, layers),
                cluster="dgx-a100",
                nodes=gpus // 8,
                batch=batch,
                method="megatron",
                degrees=(t, p, gpus // (t * p)),
                remat="on",
            )
        )
    cases.append(
        Case(
            name="llama-405b",
            model="examples/zoo/hf_llama.py",
            args=LLAMA_405B,
            cluster="dgx-h100",
            nodes=1024,
            batch=2048,
            method="megatron",
            degrees=(8, 16, 64),
            remat="on",
        )
    )
    return cases


def auto_cases() -> list[Case]:
    gpt39 = Case(
        name="gpt-39b",
        model="examples/gpt.py",
        args={"size": "39b"},
        cluster="p3.16xlarge",
        nodes=8,
        batch=256,
        method="auto",
    )
    rows = {row[0]: row for row in MEGATRON_ROWS}
    found = [gpt39]
    for params in (1.7, 7.5, 39.1, 145.6, 1008.0):
        _, heads, hidden, layers, _, _, gpus, batch = rows[params]
        found.append(
            Case(
                name=f"gpt-{params:g}b",
                model="examples/gpt.py",
                args=gpt_args(heads, hidden, layers),
                cluster="dgx-a100",
                nodes=gpus // 8,
                batch=batch,
                method="auto",
            )
        )
    return found


def command(case: Case, out: Path) -> list[str]:
    line = [
        sys.executable,
        "-m",
        "planner",
        case.model,
        "--cluster",
        case.cluster,
        "--nodes",
        str(case.nodes),
        "--batch-size",
        str(case.batch),
        "--method",
        case.method,
        "--remat",
        case.remat,
        "--jobs",
        "2",
        "--json",
        "--out",
        str(out),
    ]
    for key, value in case.args.items():
        line += ["--model-arg", f"{key}={value}"]
    if case.degrees is not None:
        line += ["--degrees", ",".join(map(str, case.degrees))]
    if case.devices_per_node is not None:
        line += ["--devices-per-node", str(case.devices_per_node)]
    if case.space != "full":
        line += ["--space", case.space]
    if case.microbatches is not None:
        line += ["--microbatches", str(case.microbatches)]
    if case.runtime != "autoplan":
        line += ["--runtime", case.runtime]
    return line


def run_case(case: Case, *, timeout_s: float, scratch: Path) -> dict:
    """One case in a fresh process: wall seconds, peak RSS (planner, capture child), the search breakdown."""
    out = scratch / f"{case.name}-{case.method}.json"
    wrapper = [sys.executable, "-m", "benchmarks.scale_cases", "--measure", json.dumps(command(case, out))]
    started = time.perf_counter()
    try:
        result = subprocess.run(
            wrapper,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    except subprocess.TimeoutExpired:
        return {"case": case, "error": f"stopped after {timeout_s:.0f} s", "wall_s": time.perf_counter() - started}
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    if measured["rc"] != 0:
        return {"case": case, "error": measured["stderr"].strip().splitlines()[-1][:110], **measured}
    plan = json.loads(out.read_text())
    return {"case": case, **measured, "plan": plan}


def measure(argv: list[str]) -> dict:
    """Run ``argv``; its wall seconds and the peak RSS of the largest process among it and its children."""
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest descendant waited for
    return {"rc": result.returncode, "wall_s": wall, "rss_gib": peak_kib / 2**20, "stderr": result.stderr[-2000:]}


if __name__ == "__main__" and sys.argv[1:2] == ["--measure"]:
    print(json.dumps(measure(json.loads(sys.argv[2]))))
