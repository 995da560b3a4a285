"""How a plan is launched: the process-group backend and the torchrun line its cluster needs.

A plan's devices are processes: one per GPU (``nccl``, one CUDA device per local rank) or one per CPU
process (``gloo``) when the plan's device is ``cpu`` (``local-cpu`` and calibrated CPU clusters).
:func:`torchrun_command` is the line ``plan``, ``plan compile`` and the generated ``train.py`` print:
one node runs ``torchrun --standalone``; several nodes run the same command on every node with
torchrun's c10d rendezvous at the first node (``--nnodes N --nproc-per-node M``).
"""

from __future__ import annotations

from cost_models.cluster import Cluster

RENDEZVOUS_PORT = 29400  # torchrun's documented default c10d rendezvous port


def is_cpu_cluster(cluster: Cluster) -> bool:
    """True when the plan's devices are CPU processes (gloo), not GPUs (nccl)."""
    return cluster.device.name.lower().startswith("cpu")


def backend_for(cluster: Cluster) -> str:
    return "gloo" if is_cpu_cluster(cluster) else "nccl"


def torchrun_command(cluster: Cluster, program: str, *, args: str = "") -> str:
    """The torchrun line that starts ``program`` with one process per device of ``cluster``."""
    tail = f"{program}{f' {args}' if args else ''}"
    if cluster.num_nodes == 1:
        return f"torchrun --standalone --nproc-per-node {cluster.devices_per_node} {tail}"
    return (
        f"torchrun --nnodes {cluster.num_nodes} --nproc-per-node {cluster.devices_per_node} "
        f"--rdzv-backend c10d --rdzv-endpoint HOST:{RENDEZVOUS_PORT} --rdzv-id JOB {tail}"
    )


def multi_node_note(cluster: Cluster) -> str:
    """What to substitute in a multi-node line (empty for one node)."""
    if cluster.num_nodes == 1:
        return ""
    return (
        f"run it on each of the {cluster.num_nodes} nodes: HOST is the first node's address, JOB any name "
        "shared by the nodes"
    )
