"""What pricing all-reduces by algorithm changes on the published rows (``python -m benchmarks.published
--collectives``): per row, its data-parallel gradient all-reduce priced as a ring (every all-reduce before issue 35
deliver 5) and as :func:`cost_models.collective_algorithms.choose_all_reduce` picks it now.

A row's first stage holds ``t·d`` ranks in a ``(d, t)`` mesh, the ``t`` tensor-parallel ranks of a replica on one
node; its data-parallel groups are axis 0 (:func:`cost_models.communication.axis_link` gives their link, NICs
shared as the estimate shares them). Two message sizes: one DDP bucket (25 MiB, ``--DDP-impl torch``) and the
stage's whole gradient in one all-reduce (``--DDP-impl local``: ``params / (t·p)`` at the optimizer's gradient
bytes). The tensor-parallel all-reduces stay inside a node, where the ring is kept (a node's tree is a chain).
Nothing here plans the rows: it prices their one collective whose algorithm can change.
"""

from __future__ import annotations

from benchmarks.published_cases import Row
from cost_models.cluster import load_cluster
from cost_models.collective_algorithms import GroupShape, choose_all_reduce, ring_all_reduce
from cost_models.communication import DDP_BUCKET_BYTES, axis_link
from cost_models.memory import optimizer_bytes
from cost_models.units import MIB

OPTIMIZER = "adam-mixed"  # the rows' plans' optimizer (benchmarks.scale_cases)


def _priced(num_bytes: float, *, num_devices: int, link) -> str:
    ring = ring_all_reduce(GroupShape.of(num_devices, link)).seconds(num_bytes)
    chosen = choose_all_reduce(num_bytes, num_devices=num_devices, link=link)
    return f"{num_bytes / MIB:,.0f} MiB | {ring * 1e3:.2f} | {chosen.algorithm} {chosen.seconds(num_bytes) * 1e3:.2f}"


def collectives_table(rows: list[Row]) -> str:
    """One line per row: its data-parallel group and both messages, ring and chosen, in ms."""
    lines = [
        "| row | GPUs | t·p·d | data-parallel group | bucket | ring ms | chosen ms "
        "| whole gradient | ring ms | chosen ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t, p, d = row.degrees
        per_node = 16 if row.cluster == "dgx-2h" else 8
        cluster = load_cluster(row.cluster, num_nodes=max(row.gpus // per_node, 1))
        if d <= 1 or t * d > cluster.num_devices:
            continue
        link = axis_link(cluster, tuple(range(t * d)), (d, t), 0)
        nodes = len({cluster.node_of(rank) for rank in range(0, t * d, t)})
        gradient = row.params_b * 1e9 / (t * p) * optimizer_bytes(OPTIMIZER).grads
        lines.append(
            f"| {row.name} | {row.gpus} | {t}·{p}·{d} | {d} devices on {nodes} nodes | "
            f"{_priced(DDP_BUCKET_BYTES, num_devices=d, link=link)} | {_priced(gradient, num_devices=d, link=link)} |"
        )
    return "\n".join(lines)
