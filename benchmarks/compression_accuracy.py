"""Gradient syncs on real data: held-out accuracy and perplexity, bytes per step, for every method, at world 2 and 4.

Two models train on data a package ships (``benchmarks/models``): a small convnet on scikit-learn's digits (held-out
accuracy; the ``evidence`` extra) and a character-level GPT on Python's own ``pydoc_data`` text (held-out
perplexity). Per model and world, one data-parallel plan per gradient sync of :data:`METHODS` (``plan`` with
``--allow-lossy --grad-sync``; the cluster ``local-cpu`` as 2 × 1 or 2 × 2 devices, so that local SGD has nodes to
average within) trains the same steps from the same seed with SGD with momentum (DGC needs it; one optimizer for
every method) at the learning rate of :data:`MODELS`, fixed before any run; ``benchmarks/compression_worker.py`` runs
them under one torchrun job and evaluates the trained weights.

Bytes per step (:func:`bytes_per_step`) are what one rank puts into the sync per step, from the parameter shapes:
exact ``4·N`` (the all-reduce's input), bf16 ``2·N``, PowerSGD its ``P`` and ``Q`` factors and uncompressed vectors,
local SGD the parameter average's ``4·N / H`` across nodes (its per-step sync stays inside a node), the gathered
kinds :func:`planner.costing.sync.wire_bytes.payload_bytes` (tested equal to the bytes the hook sends), DGA ``4·N``
(its saving is latency, not bytes), a parameter server ``4·N`` (a replica's push of every shard; the servers send the
parameters back); threshold's payload depends on the data and is not counted (—). The ratio is
exact's bytes over the method's.

    python -m benchmarks.compression_accuracy [--steps 300] [--models digits,text] [--worlds 2,4] [--save]
        [--methods exact,ps:2,...] [--add-to SAVED.json]

``--save`` writes ``benchmarks/results/compression-<date>.{json,md,png}``. ``--methods`` runs some of
:data:`METHODS`; ``--add-to`` adds their rows to an earlier saved run (a method added later), after checking that the
exact run (``exact`` must be among the methods) reproduces the saved one's losses exactly (the runs are seeded and
deterministic on the CPU), and with ``--save`` rewrites that run's files, its header listing the added command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import tempfile
from pathlib import Path

from benchmarks.compression_report import render_page, save_figure
from cost_models.cluster import load_cluster
from executors.training.launch import torchrun_argv
from planner.api import plan_model_file
from planner.costing.compression import compressed
from planner.costing.overlap import GradEntry
from planner.costing.sync.wire_bytes import payload_bytes
from planner.ir.model_file import load_model_file
from planner.plan import GradSync, Plan, save_plan

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = {  # name -> (model file, batch, learning rate): lr fixed before any run, the same for every method
    "digits": (ROOT / "benchmarks" / "models" / "digits_cnn.py", 64, 0.05),
    "text": (ROOT / "benchmarks" / "models" / "text_lm.py", 32, 0.1),
}
WORLDS = {2: (2, 1), 4: (2, 2)}  # world -> (nodes, devices per node)
METHODS = (
    "exact",
    "bf16",
    "powersgd:4",
    "local-sgd:4",
    "topk:0.01",
    "dgc:0.01",
    "onebit",
    "threshold:0.001",
    "terngrad",
    "qsgd:16",
    "signsgd",
    "ps:2",
    "ps:2:1",
    "ps:2:4",
    "dga:2",
    "dga:2@no-correction",
    "dga:8",
    "dga:8@no-correction",
)


def bytes_per_step(method: str, shapes: list[tuple[int, ...]]) -> float | None:
    """What one rank sends into the sync per step (module docstring); None where the data decides (threshold)."""
    grad_sync = GradSync.parse(method.partition("@")[0])
    numel = sum(math.prod(shape) for shape in shapes)
    if grad_sync.kind in ("exact", "dga", "ps"):
        return 4.0 * numel
    if grad_sync.kind == "bf16":
        return 2.0 * numel
    if grad_sync.kind == "local-sgd":
        return 4.0 * numel / grad_sync.period
    if grad_sync.kind == "powersgd":
        return 4.0 * sum(_powersgd_numel(shape, grad_sync.rank) for shape in shapes)
    if grad_sync.kind == "threshold":
        return None
    return float(sum(payload_bytes(grad_sync, shape) for shape in shapes))


def _powersgd_numel(shape: tuple[int, ...], rank: int) -> int:
    entry = GradEntry(name="", shape=shape, axes=())
    if not compressed(entry, rank):
        return math.prod(shape)
    rows, cols = shape[0], math.prod(shape) // shape[0]
    r = min(rows, cols, rank)
    return (rows + cols) * r


def run_case(model: str, world: int, *, steps: int, work: Path, methods: tuple[str, ...] = METHODS) -> dict:
    """Plan every method for ``model`` on ``world`` ranks, train them in one torchrun job, return the report."""
    import subprocess

    file, batch, lr = MODELS[model]
    nodes, per_node = WORLDS[world]
    cluster = load_cluster("local-cpu", num_nodes=nodes, devices_per_node=per_node)
    args = []
    for method in methods:
        choice, _, variant = method.partition("@")
        plan: Plan = plan_model_file(
            file,
            cluster,
            batch_size=batch,
            method="data-parallel",
            optimizer="sgd-momentum",
            allow_lossy=True,
            grad_sync=choice,
        )
        path = work / f"{model}-{world}-{choice.replace(':', '-')}.json"
        save_plan(plan, path)
        args.append(f"{path}@{variant}" if variant else str(path))
    out = work / f"{model}-{world}.json"
    command = torchrun_argv(
        world=world, program=ROOT / "benchmarks" / "compression_worker.py", args=[out, steps, lr, file, *args]
    )
    print(f"{model} at world {world}: {len(methods)} runs of {steps} steps ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{model} at world {world} failed:\n{done.stderr[-3000:]}")
    raw = json.loads(out.read_text())
    shapes = [tuple(p.shape) for p in load_model_file(file).build_model().parameters()]
    return {
        method: {**raw[arg], "bytes_per_step": bytes_per_step(method, shapes)}
        for method, arg in zip(methods, args, strict=True)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compression_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--render", type=Path, help="re-render the page and figure of a saved JSON (no training)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of METHODS (default: all)")
    parser.add_argument("--add-to", type=Path, help="add the rows to this saved JSON (module docstring)")
    args = parser.parse_args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        args.render.with_suffix(".md").write_text(render_page(saved["results"], saved["meta"]))
        save_figure(saved["results"], args.render.with_suffix(".png"))
        return
    methods = tuple(args.methods.split(","))
    unknown = [method for method in methods if method not in METHODS]
    if unknown or (args.add_to is not None and "exact" not in methods):
        raise SystemExit(f"--methods: use methods of {', '.join(METHODS)}, with exact when --add-to is given")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for model in args.models.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                case = f"{model}@{world}"
                results[case] = run_case(model, world, steps=args.steps, work=Path(work), methods=methods)
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()}, {platform.processor() or 'cpu'})",
        "command": "python -m benchmarks.compression_accuracy " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": args.steps,
    }
    if args.add_to is not None:
        _add_to(args.add_to, results, meta, save=args.save)
        return
    page = render_page(results, meta)
    print(page)
    if args.save:
        stem = RESULTS / f"compression-{meta['date']}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        stem.with_suffix(".md").write_text(page)
        save_figure(results, stem.with_suffix(".png"))


def _add_to(path: Path, results: dict[str, dict], meta: dict, *, save: bool) -> None:
    """Add ``results``' rows (not exact's) to the saved run at ``path``, once its exact runs reproduce (docstring)."""
    saved = json.loads(path.read_text())
    if meta["steps"] != saved["meta"]["steps"]:
        raise SystemExit(f"--add-to {path}: it ran {saved['meta']['steps']} steps, not {meta['steps']}")
    for case, rows in results.items():
        if case not in saved["results"]:
            raise SystemExit(f"--add-to {path}: it has no case {case}")
        if rows["exact"]["losses"] != saved["results"][case]["exact"]["losses"]:
            raise SystemExit(f"--add-to {path}: the exact run of {case} did not reproduce; re-run every method")
        saved["results"][case].update({method: row for method, row in rows.items() if method != "exact"})
    added = {"date": meta["date"], "machine": meta["machine"], "command": meta["command"]}
    saved["meta"]["added"] = [*saved["meta"].get("added", []), added]
    page = render_page(saved["results"], saved["meta"])
    print(page)
    if save:
        path.write_text(json.dumps(saved, indent=1))
        path.with_suffix(".md").write_text(page)
        save_figure(saved["results"], path.with_suffix(".png"))


if __name__ == "__main__":
    main()
