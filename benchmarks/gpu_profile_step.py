"""Where a one-GPU training step's time goes: GPU busy time against wall time, by kernel family.

The GPU check (:mod:`benchmarks.gpu_check`) measures a plain eager step of GPT-350M at batch 8 well above the
cost model's estimate while the operators it times one by one sit near their predictions. This script
separates the two explanations: the GPU idle between kernels (host-bound: launches, Python, the optimizer's
per-parameter loop) or kernels the model does not price (elementwise, softmax and cross-entropy, copies).
It runs the same eager step as :func:`benchmarks.gpu_check_steps.eager_step` (bf16 autocast, ``adam-mixed``,
the whole batch), warms up, then profiles ``--steps`` steps with ``torch.profiler`` and reads the Chrome trace:

* *busy* — the union of every GPU kernel, memcpy and memset interval, per step;
* *wall* — the profiled steps' ``perf_counter`` span with a CUDA synchronise at each end, per step;
* *idle* = wall − busy: the time the GPU waited for the host;
* kernel time per family (GEMM, flash attention, optimizer, elementwise, reductions and softmax, copies,
  other), summed, so families overlap nothing but may exceed *busy* when two streams run at once.

    python -m benchmarks.gpu_profile_step --out DIR [--sizes 350m,1.3b] [--steps 5] [--dry-run]

``--dry-run`` runs the tiny GPT on the CPU (no kernels: busy 0) to check the script here.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from executors.precision import Precision, make_optimizer
from planner.ir.model_file import build_kwargs, instantiate_inputs, instantiate_targets, load_model_file

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZER = "adam-mixed"
FAMILIES = (  # first match wins; lower-case substrings of the kernel name
    ("flash attention", ("flash", "fmha", "attention")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
    ("optimizer", ("multi_tensor", "foreach", "adam", "fused_")),
    ("softmax and cross-entropy", ("softmax", "nll", "log_softmax", "cross_entropy")),
    ("layer norm", ("layer_norm", "layernorm", "rms")),
    ("reduction", ("reduce",)),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, needles in FAMILIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals, in the intervals' unit."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def profile_size(size: str, *, device: str, steps: int, warmup: int, work: Path) -> dict[str, Any]:
    model_file = load_model_file(ROOT / "examples" / "gpt.py")
    model_args = {"size": size}
    batch_size = 8 if device != "cpu" else 2
    torch.manual_seed(0)
    with torch.device(device):
        model = model_file.build_model(**build_kwargs(model_file, model_args))
    inputs = tuple(
        v.to(device)
        for v in instantiate_inputs(model_file, batch_size=batch_size, model_args=model_args, on_meta=False)
    )
    targets = tuple(
        v.to(device)
        for v in instantiate_targets(model_file, batch_size=batch_size, model_args=model_args, on_meta=False)
    )
    optimizer = make_optimizer(OPTIMIZER, list(model.parameters()), lr=1e-4)
    precision = Precision.for_optimizer(OPTIMIZER)
    assert model_file.loss_fn is not None
    loss_data = targets if model_file.has_targets else inputs

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast(device):
            loss = model_file.loss_fn(model(*inputs), loss_data)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device != "cpu":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        sync()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall_s = (time.perf_counter() - started) / steps
    trace = work / f"trace-{size}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text()).get("traceEvents", [])
    trace.unlink()
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    by_family: dict[str, float] = collections.defaultdict(float)
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        by_family[family(e.get("name", ""))] += float(e["dur"]) * 1e-6 / steps
        entry = by_kernel[e.get("name", "")[:90]]
        entry[0] += float(e["dur"]) * 1e-6 / steps
        entry[1] += 1 / steps
    busy_s = busy_seconds(intervals) * 1e-6 / steps
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:20]
    return {
        "size": size,
        "batch_size": batch_size,
        "steps_profiled": steps,
        "wall_s": wall_s,
        "gpu_busy_s": busy_s,
        "gpu_idle_s": max(wall_s - busy_s, 0.0),
        "kernels_per_step": len(gpu) / steps,
        "family_s": dict(sorted(by_family.items(), key=lambda item: -item[1])),
        "top_kernels": [{"name": name, "seconds": s, "count": count} for name, (s, count) in top],
    }


def render(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        lines.append(
            f"## GPT-{row['size']}, batch {row['batch_size']}: wall {row['wall_s'] * 1e3:.1f} ms per step, "
            f"GPU busy {row['gpu_busy_s'] * 1e3:.1f} ms, idle {row['gpu_idle_s'] * 1e3:.1f} ms, "
            f"{row['kernels_per_step']:.0f} GPU activities per step\n"
        )
        lines.append("| kernel family | ms per step |\n|---|---:|")
        lines += [f"| {name} | {s * 1e3:.2f} |" for name, s in row["family_s"].items()]
        lines.append("\n| kernel | calls per step | ms per step |\n|---|---:|---:|")
        lines += [f"| `{k['name']}` | {k['count']:.0f} | {k['seconds'] * 1e3:.2f} |" for k in row["top_kernels"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile_step", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_profile.json and gpu_profile.md")
    parser.add_argument("--sizes", default="350m,1.3b", help="examples/gpt.py sizes (default 350m,1.3b)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per size (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="unprofiled steps first (default 3)")
    parser.add_argument("--dry-run", action="store_true", help="the tiny GPT on the CPU")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "gpu_profile_step.py: error: no CUDA device here: run on the GPU machine, or pass --dry-run",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.dry_run else "cuda"
    sizes = ["tiny"] if args.dry_run else [s.strip() for s in args.sizes.split(",") if s.strip()]
    rows = []
    for size in sizes:
        rows.append(profile_size(size, device=device, steps=args.steps, warmup=args.warmup, work=out))
        (out / "gpu_profile.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
        if device != "cpu":
            torch.cuda.empty_cache()
    text = render(rows)
    (out / "gpu_profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
