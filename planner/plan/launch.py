"""How a plan is launched: the process-group backend and the torchrun line its cluster needs.

A plan's devices are processes: one per GPU (``nccl``, one CUDA device per local rank) or one per CPU
process (``gloo``) when the plan's device is ``cpu`` (``local-cpu`` and calibrated CPU clusters).
:func:`torchrun_command` is the line ``plan``, ``plan compile`` and the generated ``train.py`` print:
one node runs ``torchrun --standalone``; several nodes run the same command on every node with
torchrun's c10d rendezvous at the first node (``--nnodes N --nproc-per-node M``).

:func:`launch_script` and :func:`sbatch_script` are the two launchers ``plan compile`` writes beside
``train.py``: ``launch.sh`` (torchrun on this node, or on every node with ``MASTER_ADDR`` set, NCCL's
environment variables named in comments) and ``train.sbatch`` (Slurm: one torchrun agent per node via
``srun``, the rendezvous on the job's first node). Both restart a failed job ``--max-restarts N`` times
(torchrun's own restarts, default :data:`DEFAULT_MAX_RESTARTS`): every process of the job is stopped and
started again, and ``train.py`` resumes from its newest complete checkpoint. Both export
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set): torchrun's shared rendezvous store keeps the failed
attempt's keys, and a restarted rank may read its peer's old address and time out connecting. Before torchrun,
both run ``train.py --preflight`` once (:func:`executors.training.runtime.preflight`): a mistake in the options,
the model files or the ``parallelize`` section is one line and exit code 2, not one line per restart.
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


DEFAULT_MAX_RESTARTS = 3  # torchrun restarts of a failed job before it gives up

_OPTIONS = """MAX_RESTARTS=@RESTARTS@
if [[ "${1:-}" == --max-restarts ]]; then
  MAX_RESTARTS="${2:?--max-restarts needs a number}"
  shift 2
elif [[ "${1:-}" == --max-restarts=* ]]; then
  MAX_RESTARTS="${1#--max-restarts=}"
  shift
fi
if [[ "${1:-}" == -- ]]; then
  shift
fi
read -r -a TORCHRUN <<< "${TORCHRUN:-torchrun}"  # or e.g. TORCHRUN="python -m torch.distributed.run"
# A fresh store for each attempt: with the rendezvous store shared (torch's default), a restarted job can read
# the failed attempt's addresses and time out connecting (gloo's "connectFullMesh failed", torch 2.13).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}\""""

_PREFLIGHT = (
    "# The plan, the model files, the options and parallelize() checked once, in one process (PYTHON, default\n"
    "# python3): a mistake stops here with one line and exit code 2, instead of once per torchrun restart.\n"
    '"${PYTHON:-python3}" "$HERE/train.py" --preflight "$@"'
)

_NCCL = """# NCCL's environment (set what your network needs before launching, on every node):
#   export NCCL_SOCKET_IFNAME=eth0   # the interface NCCL bootstraps over and its socket transport uses (ip -br addr)
#   export NCCL_IB_HCA=mlx5          # the InfiniBand adapters to use (ibv_devices lists them); NCCL_IB_DISABLE=1: none
#   export NCCL_DEBUG=INFO           # print NCCL's setup once (transports, rings); WARN: errors only"""

_LAUNCH = """#!/usr/bin/env bash
# Start train.py for the plan in plan.json: @NODES@ node(s) x @PER_NODE@ @DEVICE@ process(es), one per device.
# Written by plan compile; yours to edit.
#
# Usage: ./launch.sh [--max-restarts N] [--] [train.py options]     (python train.py --help, README.md)
#   --max-restarts N   restart a failed job N times (default @RESTARTS@): torchrun stops every process and starts
#                      them again, and train.py resumes from the newest complete checkpoint in --checkpoint-dir.
@USAGE@
#
@NCCL@
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
@OPTIONS@
@PREFLIGHT@
@COMMAND@
"""

_SINGLE = (
    "# One node: run it on the machine with the plan's devices.",
    'exec "${TORCHRUN[@]}" --standalone --nproc-per-node @PER_NODE@ --max-restarts "$MAX_RESTARTS" \\\n'
    '  "$HERE/train.py" "$@"',
)

_MULTI = (
    "# Several nodes: run it on each of the @NODES@ nodes with the same MASTER_ADDR (the first node's address).\n"
    "# RDZV_ID (default autoplan) names the job; RDZV_PORT (default @PORT@) is the rendezvous port on that node.",
    ': "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node, the same on every node}"\n'
    'exec "${TORCHRUN[@]}" --nnodes @NODES@ --nproc-per-node @PER_NODE@ --max-restarts "$MAX_RESTARTS" \\\n'
    '  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${RDZV_PORT:-@PORT@}" --rdzv-id "${RDZV_ID:-autoplan}" \\\n'
    '  "$HERE/train.py" "$@"',
)

_SBATCH = """#!/usr/bin/env bash
#SBATCH --job-name=autoplan
#SBATCH --nodes=@NODES@
#SBATCH --ntasks-per-node=1
@GPUS@#SBATCH --output=%x-%j.out
# Slurm launcher of train.py for the plan in plan.json: @NODES@ node(s) x @PER_NODE@ @DEVICE@ process(es).
# Written by plan compile; yours to edit (add your partition, account and time limit above).
#
# Usage, from this directory: sbatch train.sbatch [--max-restarts N] [--] [train.py options]
# Slurm runs a copy of this script: it finds train.py in the directory sbatch was called from (or PROGRAM_DIR).
# srun starts one torchrun agent per node; they meet at a c10d rendezvous on the job's first node, port
# RDZV_PORT (default @PORT@). --max-restarts N (default @RESTARTS@): torchrun restarts a failed job N times and
# train.py resumes from the newest complete checkpoint in --checkpoint-dir.
#
@NCCL@
set -euo pipefail
HERE="${PROGRAM_DIR:-${SLURM_SUBMIT_DIR:-.}}"
if [[ ! -f "$HERE/train.py" ]]; then
  echo "train.sbatch: no train.py in $HERE: submit from the program's directory, or set PROGRAM_DIR" >&2
  exit 2
fi
@OPTIONS@
@PREFLIGHT@
HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
srun --kill-on-bad-exit=1 "${TORCHRUN[@]}" --nnodes @NODES@ --nproc-per-node @PER_NODE@ \\
  --max-restarts "$MAX_RESTARTS" --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:${RDZV_PORT:-@PORT@}" \\
  --rdzv-id "$SLURM_JOB_ID" "$HERE/train.py" "$@"
"""


def _fill(text: str, cluster: Cluster, **more: str) -> str:
    """``text`` with its ``@FIELD@`` marks replaced (bash keeps its own ``$`` and ``${...}``)."""
    fields = {
        "NODES": str(cluster.num_nodes),
        "PER_NODE": str(cluster.devices_per_node),
        "DEVICE": cluster.device.name,
        "PORT": str(RENDEZVOUS_PORT),
        "RESTARTS": str(DEFAULT_MAX_RESTARTS),
        **more,
    }
    for name, value in fields.items():
        text = text.replace(f"@{name}@", value)
    return text


def _nccl_comment(cluster: Cluster) -> str:
    if is_cpu_cluster(cluster):
        return "# (A CPU plan: gloo, no NCCL. On GPUs:)\n" + _NCCL
    return _NCCL


def launch_script(cluster: Cluster) -> str:
    """``launch.sh``: torchrun for ``cluster``'s processes with ``--max-restarts`` (see the module docstring)."""
    usage, command = _SINGLE if cluster.num_nodes == 1 else _MULTI
    parts = {
        "USAGE": usage,
        "COMMAND": command,
        "OPTIONS": _OPTIONS,
        "PREFLIGHT": _PREFLIGHT,
        "NCCL": _nccl_comment(cluster),
    }
    return _fill(_fill(_LAUNCH, cluster, **parts), cluster)


def sbatch_script(cluster: Cluster) -> str:
    """``train.sbatch``: Slurm's batch script for ``cluster`` (see the module docstring)."""
    gpus = "" if is_cpu_cluster(cluster) else f"#SBATCH --gpus-per-node={cluster.devices_per_node}\n"
    parts = {"GPUS": gpus, "OPTIONS": _OPTIONS, "PREFLIGHT": _PREFLIGHT, "NCCL": _nccl_comment(cluster)}
    return _fill(_fill(_SBATCH, cluster, **parts), cluster)
