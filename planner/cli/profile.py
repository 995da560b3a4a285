"""``plan profile MODEL_FILE``: a per-operator table of shapes, FLOPs, time and memory.

Times are measured on this machine (one thread, as one local device) when the cluster's
device is this machine's CPU, and come from the roofline of the cluster's device otherwise.
When it measures, it also times the gathered gradient syncs' encode and decode
(:func:`executors.compressed_sync.timed_codec`, :data:`PROFILED_SYNCS` and ``--grad-sync`` forms) on a few sizes,
fits ``a + b·N`` to each (:mod:`cost_models.profiling.codec_profiler`), stores the fits beside the operator cache
(the planner prices those syncs with them under ``--cost-model profiled``) and prints them (:func:`codec_table`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from functools import partial

from rich.console import Console
from rich.table import Table

from cost_models.cluster import Cluster, load_cluster
from cost_models.compute import ComputeModel, NodeTime, ProfiledCompute
from cost_models.memory import saved_inputs, saves_output
from cost_models.profiling.codec_profiler import DEFAULT_SIZES, CodecCache, CodecFit, measure_codecs
from planner.costing.setup import make_compute_model
from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.graph import OpGraph, OpNode
from planner.ir.model_file import instantiate, load_model_file, parse_model_args
from planner.plan import GradSync

MIB = 1024**2
# the gathered syncs timed by default: auto's (planner.inter.grad_sync_choice.LOSSY_CHOICES) and one form of each other
PROFILED_SYNCS = ("topk:0.01", "onebit", "threshold:0.01", "terngrad", "qsgd:16", "signsgd", "dgc:0.01")


def _parser() -> argparse.ArgumentParser:
    from planner.cli.options import UsageParser, add_cluster_options, add_model_options

    parser = UsageParser(
        prog="plan profile",
        description="Per-operator table: name, target, kind, output shape, FLOPs, forward/backward time, memory.",
    )
    add_model_options(parser)
    add_cluster_options(parser, required=False)
    parser.add_argument(
        "--measure",
        choices=("auto", "yes", "no"),
        default="auto",
        help="time operators on this machine (auto: when the cluster's device is this CPU)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per operator (median is reported)")
    parser.add_argument(
        "--top", type=int, default=0, metavar="N", help="only the N slowest operators (0: all, in order)"
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument(
        "--compressors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when measuring, also time the gathered gradient syncs' encode and decode, fit seconds = a + b·N per "
        f"sync and store it for --cost-model profiled (default on: {', '.join(PROFILED_SYNCS)})",
    )
    parser.add_argument(
        "--grad-sync",
        action="append",
        default=[],
        metavar="FORM",
        help="time this gathered sync too (e.g. topk:0.001; repeatable)",
    )
    parser.add_argument(
        "--codec-sizes",
        default=",".join(str(size) for size in DEFAULT_SIZES),
        metavar="N,N,...",
        help="gradient elements the compressors are timed at (default %(default)s)",
    )
    return parser


def _compute_model(graph: OpGraph, cluster: Cluster, *, measure: str, repeats: int) -> ComputeModel:
    local = cluster.device.name.startswith("cpu")
    measured = measure == "yes" or (measure == "auto" and local)
    return make_compute_model(graph, cluster, cost_model="profiled" if measured else "roofline", repeats=repeats)


def _saved_bytes(node: OpNode, graph: OpGraph) -> int:
    total = sum(node.input_metas[i].nbytes for i in saved_inputs(node) if node.inputs[i] not in graph.param_names)
    return total + (node.output.nbytes if saves_output(node) else 0)


def profile_rows(graph: OpGraph, compute: ComputeModel) -> list[dict]:
    rows = []
    measured = compute.table if isinstance(compute, ProfiledCompute) else {}
    for node in graph.nodes:
        time: NodeTime = compute.node_time(node)
        rows.append(
            {
                "name": node.name,
                "target": node.target,
                "kind": node.kind.value,
                "module": node.module_path,
                "output_shape": list(node.output.shape),
                "flops_fwd": node.flops_fwd,
                "flops_bwd": node.flops_bwd,
                "fwd_s": time.fwd_s,
                "bwd_s": time.bwd_s,
                "measured": node.signature() in measured,
                "output_bytes": node.output.nbytes,
                "saved_bytes": _saved_bytes(node, graph),
            }
        )
    return rows


def run_profile(argv: Sequence[str]) -> int:
    options = _parser().parse_args(list(argv))
    cluster = load_cluster(options.cluster, num_nodes=options.nodes, devices_per_node=options.devices_per_node)
    model_file = load_model_file(options.model_file)
    model, inputs = instantiate(
        model_file, batch_size=options.batch_size, model_args=parse_model_args(options.model_arg)
    )
    graph = capture(model, inputs, tracer=options.tracer, reuse_layers=True)
    console = Console(stderr=True)
    with console.status(f"timing {len(graph)} operators"):
        compute = _compute_model(graph, cluster, measure=options.measure, repeats=options.repeats)
    rows = profile_rows(graph, compute)
    fits = {}
    if options.compressors and isinstance(compute, ProfiledCompute):
        with console.status("timing the gradient compressors"):
            fits = profile_codecs((*PROFILED_SYNCS, *options.grad_sync), sizes=options.codec_sizes)
    shown = sorted(rows, key=lambda r: -(r["fwd_s"] + r["bwd_s"]))[: options.top] if options.top > 0 else rows
    if options.json:
        print(json.dumps(shown, indent=2))
        return 0
    Console(width=200).print(_table(shown, rows, cluster, graph))
    if fits:
        Console(width=200).print(codec_table(fits))
    return 0


def profile_codecs(forms: Sequence[str], *, sizes: str) -> dict[str, CodecFit]:
    """Time the gathered syncs ``forms`` at ``sizes`` (``N,N,...``) on this CPU and store their fits."""
    from executors.compressed_sync import timed_codec

    syncs = [GradSync.parse(form) for form in dict.fromkeys(forms)]
    for grad_sync in syncs:
        if not grad_sync.gathered:
            raise AutoplanError(f"--grad-sync {grad_sync.label}: only the gathered syncs have compressors to time")
    try:
        numels = tuple(int(size) for size in sizes.split(","))
    except ValueError:
        raise AutoplanError(f"--codec-sizes {sizes!r}: give element counts, e.g. 4096,65536") from None
    factories = {grad_sync.label: partial(timed_codec, grad_sync) for grad_sync in syncs}
    fits = measure_codecs(factories, sizes=numels)
    CodecCache(device="cpu").save(fits)
    return fits


def codec_table(fits: Mapping[str, CodecFit]) -> Table:
    """The fitted encode and decode lines, and what they give at 1M elements."""
    table = Table(title="gradient compressors, measured here (one thread): seconds = a + b·N")
    for column in ("sync", "encode a µs", "encode ns/elem", "decode a µs", "decode ns/elem", "1M: enc+dec ms"):
        table.add_column(column, justify="left" if column == "sync" else "right")
    for label, fit in fits.items():
        table.add_row(
            label,
            f"{fit.encode.fixed_s * 1e6:.1f}",
            f"{fit.encode.per_element_s * 1e9:.3f}",
            f"{fit.decode.fixed_s * 1e6:.1f}",
            f"{fit.decode.per_element_s * 1e9:.3f}",
            f"{(fit.encode(2**20) + fit.decode(2**20)) * 1e3:.2f}",
        )
    table.caption = "decode: one received payload read and added into the sum; stored for --cost-model profiled"
    return table


def _table(shown: list[dict], rows: list[dict], cluster: Cluster, graph: OpGraph) -> Table:
    source = "measured here" if any(r["measured"] for r in rows) else f"roofline of {cluster.device.name}"
    table = Table(title=f"{len(rows)} operators, {graph.num_params / 1e6:,.2f}M parameters; times {source}")
    for column in ("name", "target", "kind", "output", "GFLOP f+b", "fwd ms", "bwd ms", "out MiB", "saved MiB"):
        table.add_column(
            column, justify="right" if column[0].isupper() or "ms" in column or "MiB" in column else "left"
        )
    for row in shown:
        table.add_row(
            row["name"],
            row["target"],
            row["kind"],
            "×".join(str(s) for s in row["output_shape"]),
            f"{(row['flops_fwd'] + row['flops_bwd']) / 1e9:.3f}",
            f"{row['fwd_s'] * 1e3:.3f}" + ("" if row["measured"] or row["kind"] == "view" else "*"),
            f"{row['bwd_s'] * 1e3:.3f}",
            f"{row['output_bytes'] / MIB:.2f}",
            f"{row['saved_bytes'] / MIB:.2f}",
        )
    totals = [sum(r[key] for r in rows) for key in ("flops_fwd", "flops_bwd", "fwd_s", "bwd_s", "output_bytes")]
    table.add_section()
    table.add_row(
        "total",
        "",
        "",
        "",
        f"{(totals[0] + totals[1]) / 1e9:.3f}",
        f"{totals[2] * 1e3:.3f}",
        f"{totals[3] * 1e3:.3f}",
        f"{totals[4] / MIB:.2f}",
        "",
    )
    table.caption = "* estimated by the roofline (not measured)" if any(not r["measured"] for r in rows) else None
    return table
