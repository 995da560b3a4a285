"""Operator times on the device against the operator model: GEMMs, fused attention, LayerNorm and RMSNorm.

Each case is one operator at a layer's shape of GPT-350M, GPT-1.3B (``examples/gpt.py``: batch 8 ×
sequence 1024 = 8192 tokens) or Llama-3-8B (hidden 4096, MLP 14336, 32 query and 8 key/value heads of 128,
vocabulary 128256; batch 2 × sequence 4096 = 8192 tokens; attention after the key/value heads are repeated,
as Hugging Face's SDPA path runs it). For each case:

* **predicted** — a one-operator module is built on the meta device in fp32 and captured as the planner
  captures a model (:func:`planner.ir.capture.capture`); every node is priced by the compute model of the
  device's cluster (:func:`planner.costing.setup.make_compute_model`, roofline: on a GPU the kernel shape
  model of :mod:`cost_models.gemm_efficiency`); forward and backward are the sums of the nodes' ``fwd_s``
  and ``bwd_s``. For a linear layer the backward's two GEMMs are also priced one by one, each as the
  forward is: ``max(gemm_s(shape), bytes / (bandwidth · memory_efficiency)) + kernel_overhead_s`` with
  the shapes of :func:`cost_models.gemm_efficiency.backward_shapes` (``dX = dY·W``, ``dW = dYᵀ·X``) and
  2-byte operands;
* **measured** — the same module in bf16 on the device (``--dry-run``: on the CPU), inputs requiring
  gradients; forward = one call, backward = ``torch.autograd.grad`` of the output for the inputs and
  parameters (graph retained), ``dX``/``dW`` = the two matmuls alone; attention under
  ``sdpa_kernel(FLASH_ATTENTION)``. Timed by :class:`gpu_check_device.Timer` (CUDA events, L2 evicted
  before each call, median after warm-up).

What a training step does differently is not here: under ``adam-mixed`` autocast runs the norms in fp32
and the residual stream stays fp32 (the step section measures that).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu_check_device import Timer
from cost_models.cluster import Cluster
from cost_models.device import DeviceSpec
from cost_models.gemm_efficiency import GemmShape, attention_flops, backward_shapes, gemm_s, matmul_shape
from planner.costing.setup import make_compute_model
from planner.ir.capture import capture
from planner.ir.graph import NodeKind, OpGraph


@dataclass(frozen=True, kw_only=True)
class OpCase:
    model: str
    op: str
    kind: str  # linear | attention | layer_norm | rms_norm
    # linear: (tokens, in, out); attention: (batch, heads, seq, head_dim); norms: (batch, seq, hidden)
    shape: tuple[int, ...]
    bias: bool = True


def _linears(model: str, tokens: int, sites: dict[str, tuple[int, int]], *, bias: bool) -> list[OpCase]:
    return [
        OpCase(model=model, op=op, kind="linear", shape=(tokens, fan_in, fan_out), bias=bias and op != "lm_head")
        for op, (fan_in, fan_out) in sites.items()
    ]


def full_cases() -> list[OpCase]:
    """The GPT-350M, GPT-1.3B and Llama-3-8B shapes (module docstring)."""
    cases = []
    for model, hidden, heads, vocab in (("gpt-350m", 1024, 16, 51200), ("gpt-1.3b", 2048, 32, 51200)):
        sites = {
            "attn.q": (hidden, hidden),
            "mlp.fc": (hidden, 4 * hidden),
            "mlp.proj": (4 * hidden, hidden),
            "lm_head": (hidden, vocab),
        }
        cases += _linears(model, 8 * 1024, sites, bias=True)
        cases.append(OpCase(model=model, op="attention", kind="attention", shape=(8, heads, 1024, hidden // heads)))
        cases.append(OpCase(model=model, op="ln_1", kind="layer_norm", shape=(8, 1024, hidden)))
    llama = {
        "q_proj": (4096, 4096),
        "k_proj": (4096, 1024),
        "gate_proj": (4096, 14336),
        "down_proj": (14336, 4096),
        "lm_head": (4096, 128256),
    }
    cases += _linears("llama-8b", 2 * 4096, llama, bias=False)
    cases.append(OpCase(model="llama-8b", op="attention", kind="attention", shape=(2, 32, 4096, 128)))
    cases.append(OpCase(model="llama-8b", op="input_layernorm", kind="rms_norm", shape=(2, 4096, 4096)))
    return cases


def dry_cases() -> list[OpCase]:
    """One tiny case of each kind, for the CPU dry run."""
    return [
        OpCase(model="tiny", op="mlp.fc", kind="linear", shape=(64, 64, 256)),
        OpCase(model="tiny", op="attention", kind="attention", shape=(2, 4, 32, 16)),
        OpCase(model="tiny", op="ln_1", kind="layer_norm", shape=(2, 32, 64)),
        OpCase(model="tiny", op="norm", kind="rms_norm", shape=(2, 32, 64)),
    ]


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def build(case: OpCase, *, device: str, dtype: torch.dtype, grad: bool) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The case's one-operator module and its inputs on ``device`` (random values unless on meta)."""
    make = torch.empty if device == "meta" else torch.randn
    with torch.device(device):
        if case.kind == "linear":
            tokens, fan_in, fan_out = case.shape
            module: nn.Module = nn.Linear(fan_in, fan_out, bias=case.bias)
            shapes = [(tokens, fan_in)]
        elif case.kind == "attention":
            module, shapes = _Attention(), [case.shape] * 3
        elif case.kind in ("layer_norm", "rms_norm"):
            hidden = case.shape[-1]
            module, shapes = (nn.LayerNorm(hidden) if case.kind == "layer_norm" else nn.RMSNorm(hidden)), [case.shape]
        else:
            raise ValueError(f"unknown operator kind {case.kind!r}")
        inputs = tuple(make(shape, dtype=dtype, requires_grad=grad) for shape in shapes)
    return module.to(dtype=dtype), inputs


def captured(case: OpCase) -> OpGraph:
    module, inputs = build(case, device="meta", dtype=torch.float32, grad=False)
    return capture(module, inputs)


def _gemm_part_s(device: DeviceSpec, shape: GemmShape) -> float:
    """One backward GEMM as the forward is priced: kernel model against 2-byte operand traffic."""
    peak = device.peak("bfloat16")
    if device.kernels is not None:
        compute_s = gemm_s(device.kernels, shape, peak=peak)
    else:
        compute_s = shape.flops / (peak * device.compute_efficiency)
    batch, m, n, k = shape
    memory_s = 2 * batch * (m * n + n * k + m * k) / (device.memory_bandwidth * device.memory_efficiency)
    return max(compute_s, memory_s) + device.kernel_overhead_s


def predict(case: OpCase, cluster: Cluster) -> dict[str, dict[str, float]]:
    """Pass -> {"predicted_s", "flops"} from the captured graph and the cluster's compute model."""
    graph = captured(case)
    compute = make_compute_model(graph, cluster, cost_model="roofline")
    times = [compute.node_time(node) for node in graph.nodes]
    fwd_flops = bwd_flops = 0.0
    for node in graph.nodes:
        work = attention_flops(node, flops_fwd=node.flops_fwd) if node.kind == NodeKind.ATTENTION else None
        fwd_flops += work[0] if work else node.flops_fwd
        bwd_flops += work[1] if work else node.flops_bwd
    passes = {
        "fwd": {"predicted_s": sum(t.fwd_s for t in times), "flops": fwd_flops},
        "bwd": {"predicted_s": sum(t.bwd_s for t in times), "flops": bwd_flops},
    }
    if case.kind == "linear":
        node = next(node for node in graph.nodes if node.kind == NodeKind.MATMUL)
        shape = matmul_shape(node, output_shape=node.output.shape, flops=node.flops_fwd)
        assert shape is not None, f"{case.op}: a linear layer is a GEMM"
        for name, part in zip(("dX", "dW"), backward_shapes(shape), strict=True):
            passes[name] = {"predicted_s": _gemm_part_s(cluster.device, part), "flops": float(part.flops)}
    return passes


def _measured_work(case: OpCase, *, device: str) -> dict[str, Callable[[], object]]:
    """Pass -> a callable that runs it once on ``device`` in bf16."""
    module, inputs = build(case, device=device, dtype=torch.bfloat16, grad=True)
    params = [p for p in module.parameters() if p.requires_grad]

    def forward() -> torch.Tensor:
        if case.kind != "attention":
            return module(*inputs)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return module(*inputs)

    output = forward()
    grad_output = torch.randn_like(output)
    work: dict[str, Callable[[], object]] = {
        "fwd": forward,
        "bwd": lambda: torch.autograd.grad(output, [*inputs, *params], grad_output, retain_graph=True),
    }
    if case.kind == "linear":
        x, weight = inputs[0], module.weight.detach()
        dy = grad_output.detach()
        work["dX"] = lambda: dy @ weight
        work["dW"] = lambda: dy.t() @ x.detach()
    return work


def measure(case: OpCase, *, device: str, timer: Timer) -> dict[str, dict[str, Any]]:
    """Pass -> {"measured_s", "times_s"}."""
    work = _measured_work(case, device=device)
    results = {}
    for name, call in work.items():
        timing = timer(call)
        results[name] = {"measured_s": timing.median_s, "times_s": list(timing.times_s)}
    return results


def _shape_text(case: OpCase) -> str:
    if case.kind == "linear":
        tokens, fan_in, fan_out = case.shape
        return f"{tokens}×{fan_in} → {fan_out}" + ("" if case.bias else ", no bias")
    if case.kind == "attention":
        batch, heads, seq, head_dim = case.shape
        return f"B{batch} H{heads} S{seq} D{head_dim}, causal"
    return "×".join(str(size) for size in case.shape)


def operator_rows(
    cases: list[OpCase],
    *,
    cluster: Cluster,
    device: str,
    timer: Timer,
    deadline: float,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One row per case and pass; a case that fails or finds the time spent is one row saying so."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        head = {"model": case.model, "op": case.op, "kind": case.kind, "shape": _shape_text(case)}
        if time.monotonic() > deadline:
            rows.append({**head, "skipped": "the section's time was spent"})
            continue
        try:
            predicted = predict(case, cluster)
            measured = measure(case, device=device, timer=timer)
        except Exception as error:  # one case's failure (out of memory, no flash kernel) is its row
            rows.append({**head, "error": f"{type(error).__name__}: {str(error).strip()[:300]}"})
            log(f"operators: {case.model} {case.op}: {type(error).__name__}: {error}")
        else:
            for name, values in predicted.items():
                rows.append({**head, "pass": name, **values, **measured[name]})
            text = ", ".join(
                f"{n} {measured[n]['measured_s'] * 1e3:.3f}/{p['predicted_s'] * 1e3:.3f} ms"
                for n, p in predicted.items()
            )
            log(f"operators: {case.model} {case.op} measured/predicted {text}")
        finally:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows
