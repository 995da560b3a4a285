"""Host seconds PyTorch eager spends per operator call, forward and backward: the GPU presets' ``host_dispatch_s``.

A GPU runs an eager PyTorch program no faster than its host issues the kernels: every operator call goes through
the Python binding, the dispatcher and autograd (recording a node in forward, running it in backward) before its
kernel is launched (:mod:`cost_models.gemm_efficiency`, ``KernelSpec.host_dispatch_s``). This measures that host
path on this machine's CPU, on tensors so small that the kernels themselves take almost nothing: a chain of
``--ops`` transformer-layer operators (linear, layer_norm, gelu, dropout, add, softmax, matmul, view/transpose) on
one-row inputs that require gradients, timed forward and backward separately over ``--repeats`` runs after warm-up,
per priced operator call (the views' host time shared out over the others, as the cost model prices views at
nothing; a backward pass's time per forward operator). One thread. The constant is the fastest run (the least
disturbed by other processes on a shared machine: noise only adds), rounded to whole microseconds.

What it leaves out: the CUDA launch call itself (``cudaLaunchKernel``) and the CUDA dispatch key's work (caching
allocator, stream bookkeeping) — on a GPU host each call costs more than measured here, so the figure is a lower
bound. The machine is not a DGX host either (a shared 2-core VM here). The constant is set once from this
measurement, before and independently of the published runs it is then scored on (``benchmarks/published.py``).

    python -m benchmarks.dispatch_overhead [--ops 400] [--repeats 15] [--save]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.results_page import save_table

WIDTH = 8  # features per row: the kernels' own work is negligible
# calls per layer the cost model prices (layer_norm, 2 linear, 2 matmul, mul, softmax, dropout, gelu, add); its 5 views
# (view, 3 transposes, reshape) dispatch on the host too but are priced at nothing: their host time is shared out
PRICED_CALLS = 10


def layer(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """One small transformer-like layer of eager calls; returns the output and the number of operator calls."""
    h = F.layer_norm(x, (WIDTH,), weights["ln_w"], weights["ln_b"])
    q = F.linear(h, weights["q"], weights["qb"]).view(1, 2, WIDTH // 2).transpose(0, 1)
    scores = torch.matmul(q, q.transpose(-2, -1)) * 0.5
    probs = F.dropout(torch.softmax(scores, dim=-1), 0.1, training=True)
    y = torch.matmul(probs, q).transpose(0, 1).reshape(1, WIDTH)
    y = F.gelu(F.linear(y, weights["o"], weights["ob"]), approximate="tanh")
    return x + y, PRICED_CALLS


def measure(*, ops: int, repeats: int) -> tuple[list[float], list[float], int]:
    torch.manual_seed(0)
    shapes = {
        "ln_w": (WIDTH,),
        "ln_b": (WIDTH,),
        "q": (WIDTH, WIDTH),
        "qb": (WIDTH,),
        "o": (WIDTH, WIDTH),
        "ob": (WIDTH,),
    }
    weights = {name: torch.randn(*shape, requires_grad=True) for name, shape in shapes.items()}
    forward_s, backward_s, calls = [], [], 0
    for attempt in range(repeats + 3):  # three warm-up runs
        x = torch.randn(1, WIDTH, requires_grad=True)
        started = time.perf_counter()
        calls = 0
        while calls < ops:
            x, count = layer(x, weights)
            calls += count
        loss = x.sum()
        middle = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        if attempt >= 3:
            forward_s.append((middle - started) / calls)
            backward_s.append((ended - middle) / calls)
    return forward_s, backward_s, calls


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=400, help="operator calls per run")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs (after three warm-up runs)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/dispatch_overhead-<date>.md")
    options = parser.parse_args()
    torch.set_num_threads(1)
    forward_s, backward_s, calls = measure(ops=options.ops, repeats=options.repeats)
    rows = ["| pass | min µs per priced operator call | median | max |", "|---|---:|---:|---:|"]
    for name, values in (("forward", forward_s), ("backward", backward_s)):
        rows.append(
            f"| {name} | {min(values) * 1e6:.2f} | {statistics.median(values) * 1e6:.2f} | {max(values) * 1e6:.2f} |"
        )
    table = "\n".join(rows)
    print(table)
    if options.save:
        description = (
            f"torch {torch.__version__}, one thread, {calls} priced operator calls per run, "
            f"{options.repeats} timed runs "
            "after 3 warm-up runs; min, median and max over them. Tensors of one row of "
            f"{WIDTH} features that require gradients: the time is the host path (Python binding, dispatcher, "
            "autograd), not the kernels. The CUDA launch call is not in it: a lower bound for a GPU host."
        )
        command = "python -m benchmarks.dispatch_overhead " + " ".join(sys.argv[1:])
        save_table(
            "dispatch_overhead",
            title="PyTorch eager host time per operator call",
            command=command,
            description=description,
            table=table,
        )


if __name__ == "__main__":
    main()
