"""Slow links: which gradient sync auto picks, and what each sync's estimate is, on a fast and two slow clusters.

The clusters: two DGX-A100 nodes (the preset: NVSwitch inside, 8 × 200 Gbit/s between), eight single-A100 machines
on 1 Gbit/s Ethernet (``examples/clusters/ethernet-1g.toml``) and two DGX-A100 nodes in two regions with 200 ms
between them (``examples/clusters/cross-region.toml``). The models: GPT-350M (``examples/gpt.py``, batch 32) and a
ResNet-50-like convnet (``examples/resnet.py`` at width 64, four stages of four blocks, 1,000 classes, 224 × 224
images, batch 64; its parameter count is printed). Per model and cluster:

* **auto**: ``plan`` with ``--allow-lossy`` (auto may pick any choice of
  :data:`planner.inter.grad_sync_choice.LOSSY_CHOICES`) against auto with exact sync: the plan's shape, the sync it
  picked and how much faster its estimate is;
* **every sync on the data-parallel plan**: ``--method data-parallel --allow-lossy --grad-sync KIND`` for each kind
  of :data:`SYNCS` (forced: the ones auto may not pick too; DGC with ``--optimizer sgd-momentum``, the one it runs
  with), its step estimate and the part of it the gradient sync leaves exposed after the backward (the
  ``Estimate.breakdown_s`` parts named for a sync: DGA's row shows what its ``D`` steps did not hide) and, for DGA
  (and a stale parameter server, ``ps:S:K``, its push), the communication the simulated step runs behind the next
  ``D`` (``K``) steps (``hidden``: the plan replayed by
  ``plan show``'s simulator, :func:`planner.costing.sync.delayed.sync_timeline`; hidden + exposed is the whole
  all-reduce, and the simulated step is the estimate).

Every all-reduce is priced by the algorithm NCCL would run (:mod:`cost_models.collective_algorithms`: ring, tree, or
its node-by-node ring): across two regions 200 ms apart latency, not bandwidth, dominates exact sync; the all-gathers
of the compressors stay rings (``n − 1`` hops); a parameter server pays one latency for its push and one for its
pull, but its ``S`` servers' links carry every replica's shard (``ps:2`` on eight machines: two links for eight).

Nothing here is measured: these are the cost model's estimates (roofline costs), the what-if a user on such a
link would read before running. ``python -m benchmarks.slow_links [--save]`` (``--save`` writes
``benchmarks/results/slow_links-<date>.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
import time
from pathlib import Path

from cost_models.cluster import Cluster, load_cluster
from planner.api import plan_prepared, prepare_model_file
from planner.cli.show import simulate_recorded
from planner.costing.sync.delayed import sync_timeline
from planner.errors import AutoplanError
from planner.plan import GradSync, Plan

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {  # name -> (model file, model arguments, batch)
    "GPT-350M": (ROOT / "examples" / "gpt.py", {"size": "350m"}, 32),
    "ResNet-50-like": (
        ROOT / "examples" / "resnet.py",
        {"width": 64, "blocks": 4, "stages": 4, "num_classes": 1000, "image_size": 224},
        64,
    ),
}
SYNCS = (
    "exact",
    "bf16",
    "powersgd:4",
    "local-sgd:16",
    "topk:0.01",
    "dgc:0.001",
    "onebit",
    "terngrad",
    "qsgd:16",
    "signsgd",
    "dga:4",
    "ps:2",
    "ps:2:4",
)


def clusters() -> dict[str, Cluster]:
    return {
        "2 × DGX-A100": load_cluster("dgx-a100", num_nodes=2),
        "8 × A100, 1 Gbit/s": load_cluster(str(ROOT / "examples" / "clusters" / "ethernet-1g.toml")),
        "2 regions, 200 ms": load_cluster(str(ROOT / "examples" / "clusters" / "cross-region.toml")),
    }


def _sync_part_s(plan: Plan) -> float:
    """The estimate's gradient-sync part (the breakdown's parts named for the sync; 0 when it has none)."""
    return sum(value for key, value in plan.estimate.breakdown_s.items() if "sync" in key)


def auto_rows(model: str, cluster_name: str, cluster: Cluster) -> list[str]:
    file, args, batch = MODELS[model]
    prepared = prepare_model_file(file, cluster, batch_size=batch, model_args=args, allow_lossy=True)
    lossy = plan_prepared(prepared, "auto")
    exact = plan_prepared(
        dataclasses.replace(prepared, options=dataclasses.replace(prepared.options, allow_lossy=False)), "auto"
    )
    speedup = exact.estimate.step_time_s / lossy.estimate.step_time_s
    return [
        f"| {model} | {cluster_name} | {lossy.grad_sync.label} | {lossy.method} | {exact.estimate.step_time_s:.4f} | "
        f"{lossy.estimate.step_time_s:.4f} | {speedup:.2f}× |"
    ]


def sync_rows(model: str, cluster_name: str, cluster: Cluster) -> list[str]:
    """One row per sync of :data:`SYNCS` on the data-parallel plan (DGC's under SGD with momentum, its optimizer)."""
    file, args, batch = MODELS[model]
    prepared = {
        optimizer: prepare_model_file(
            file,
            cluster,
            batch_size=batch,
            model_args=args,
            allow_lossy=True,
            method="data-parallel",
            optimizer=optimizer,
        )
        for optimizer in (None, "sgd-momentum")
    }
    rows, exact_s = [], None
    for text in SYNCS:
        grad_sync = GradSync.parse(text)
        base = prepared["sgd-momentum" if grad_sync.kind == "dgc" else None]
        options = dataclasses.replace(base.options, grad_sync=grad_sync)
        try:
            plan = plan_prepared(dataclasses.replace(base, options=options), "data-parallel")
        except AutoplanError as error:
            rows.append(f"| {model} | {cluster_name} | {text} | refused: {str(error)[:90]} | | | | |")
            continue
        step_s = plan.estimate.step_time_s
        exact_s = step_s if text == "exact" else exact_s
        ratio = f"{exact_s / step_s:.2f}×" if exact_s else ""
        rows.append(
            f"| {model} | {cluster_name} | {text} | {step_s:.4f} | {_sync_part_s(plan):.4f} | {_hidden(plan)} | "
            f"{ratio} | {plan.grad_sync.describe()[:60]}… |"
        )
    return rows


def _hidden(plan: Plan) -> str:
    """DGA's communication (a stale parameter server's push) behind the next steps in the replayed step (empty for
    the other syncs)."""
    if plan.grad_sync.kind != "dga" and not plan.grad_sync.staleness:
        return ""
    return f"{sync_timeline(simulate_recorded(plan)).hidden_s:.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_links",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--save", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    found = clusters()
    auto = [
        "| model | cluster | auto's sync | method | exact-sync auto (s) | lossy auto (s) | faster |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    every = [
        "| model | cluster | sync | data-parallel step (s) | of it, sync (s) | hidden (s) | vs exact "
        "| what it changes |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for model in MODELS:
        for name, cluster in found.items():
            print(f"{model} on {name} ...", file=sys.stderr, flush=True)
            auto += auto_rows(model, name, cluster)
            every += sync_rows(model, name, cluster)
    date = datetime.date.today().isoformat()
    page = "\n".join(
        [
            f"# Slow links: the gradient sync auto picks — {date}",
            "",
            f"Machine: {platform.node()}; command `python -m benchmarks.slow_links {' '.join(argv or sys.argv[1:])}`; "
            f"{time.perf_counter() - started:.0f} s. Estimates only (module docstring of `benchmarks/slow_links.py`).",
            "",
            "## Auto with `--allow-lossy` against auto with exact sync",
            "",
            *auto,
            "",
            "## Every sync on the data-parallel plan",
            "",
            *every,
            "",
        ]
    )
    print(page)
    if args.save:
        (RESULTS / f"slow_links-{date}.md").write_text(page)


if __name__ == "__main__":
    main()
