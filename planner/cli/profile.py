"""``plan profile MODEL_FILE``: a per-operator table of shapes, FLOPs, time and memory.

Times are measured on this machine (one thread, as one local device) when the cluster's
device is this machine's CPU, and come from the roofline of the cluster's device otherwise.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from cost_models.cluster import Cluster, load_cluster
from cost_models.compute import ComputeModel, NodeTime, ProfiledCompute
from cost_models.memory import saved_inputs, saves_output
from planner.costing.setup import make_compute_model
from planner.ir.capture import capture
from planner.ir.graph import OpGraph, OpNode
from planner.ir.model_file import instantiate, load_model_file, parse_model_args

MIB = 1024**2


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
    graph = capture(model, inputs, tracer=options.tracer)
    console = Console(stderr=True)
    with console.status(f"timing {len(graph)} operators"):
        compute = _compute_model(graph, cluster, measure=options.measure, repeats=options.repeats)
    rows = profile_rows(graph, compute)
    shown = sorted(rows, key=lambda r: -(r["fwd_s"] + r["bwd_s"]))[: options.top] if options.top > 0 else rows
    if options.json:
        print(json.dumps(shown, indent=2))
        return 0
    Console(width=200).print(_table(shown, rows, cluster, graph))
    return 0


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
