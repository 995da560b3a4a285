"""The results page of ``benchmarks/gpu_check.py``: ``gpu_check.json`` as ``benchmarks/results/gpu-DATE.md``.

Every ratio is measured ÷ predicted (above 1: slower or larger than the model says). Every row is listed,
the ones that failed or ran out of time too, and every timed step of a training run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

GIB = 2**30
RESULTS = Path(__file__).resolve().parent / "results"
DEVICE_CALL = (
    "the `run` call of benchmarks/results/README.md: wheels installed from `.whl`, then "
    "`python3 -m benchmarks.gpu_check --out $OUT`"
)


def _ratio(measured: float | None, predicted: float | None) -> str:
    if not measured or not predicted:
        return "—"
    return f"{measured / predicted:.2f}"


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def header(result: Mapping[str, Any]) -> str:
    machine, cluster = result["machine"], result.get("cluster")
    gpu = machine.get("gpu") or "none (dry run on the CPU: the timings are not GPU figures)"
    if machine.get("gpu_memory_bytes"):
        gpu += (
            f", {machine['gpu_memory_bytes'] / GIB:.1f} GiB, {machine['gpu_sms']} SMs, sm_{machine['gpu_capability']}"
        )
    solvers = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in machine.get("solvers", {}).items()) or "unknown"
    sections = "; ".join(
        f"{name} {s['status']} in {s['seconds']:.0f} s" + (f" ({s['error']})" if s.get("error") else "")
        for name, s in result["sections"].items()
    )
    lines = [
        f"# GPU check{' (dry run)' if result.get('dry_run') else ''}, {result['started'][:10]}",
        "",
        f"Machine: {gpu}; {machine.get('cpus', '?')} CPUs, {machine.get('platform', '?')}, Python {machine['python']}, "
        f"torch {machine['torch']}, CUDA {machine.get('cuda')}; solvers for planning: {solvers}.",
        f"Priced as: {cluster['device']} ({cluster['note']})." if cluster else "Priced as: (setup failed).",
        f"Command: `{result.get('command', '')}` ({DEVICE_CALL}); budget {result['budget_s']:.0f} s.",
        "",
        f"Setup failed: {result['setup_error']}" if result.get("setup_error") else f"Sections: {sections}.",
        "Ratios are measured ÷ predicted.",
    ]
    return "\n".join(lines)


def operator_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| model | operator | shape | pass | predicted ms | measured ms | ratio | measured TFLOP/s |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        where = f"| {row['model']} | {row['op']} | {row['shape']} "
        if "pass" not in row:
            lines.append(where + f"| — | — | — | {row.get('error') or row.get('skipped')} | — |")
            continue
        rate = f"{row['flops'] / row['measured_s'] / 1e12:.3g}" if row.get("flops") else "—"
        lines.append(
            where + f"| {row['pass']} | {row['predicted_s'] * 1e3:.3f} | {row['measured_s'] * 1e3:.3f} | "
            f"{_ratio(row['measured_s'], row['predicted_s'])} | {rate} |"
        )
    return "\n".join(lines)


def operator_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """Geometric-mean ratio and range per operator kind and pass."""
    groups: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        if "pass" in row and row["predicted_s"] > 0 and row["measured_s"] > 0:
            groups.setdefault((row["kind"], row["pass"]), []).append(row["measured_s"] / row["predicted_s"])
    lines = ["| kind | pass | rows | geometric mean ratio | smallest | largest |", "|---|---|---:|---:|---:|---:|"]
    for (kind, name), ratios in groups.items():
        lines.append(
            f"| {kind} | {name} | {len(ratios)} | {_geomean(ratios):.2f} | {min(ratios):.2f} | {max(ratios):.2f} |"
        )
    return "\n".join(lines)


def step_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| model | batch | run | plan | predicted step ms | measured step ms | ratio | predicted GiB | measured GiB "
        "| ratio | memory measured as |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        for part in ("program", "eager"):
            got = row.get(part, {})
            where = f"| {row['model']} | {row['batch_size']} | {part} "
            if "measured_step_s" not in got:
                lines.append(where + f"| {got.get('error') or got.get('skipped')} |" + " — |" * 7)
                continue
            lines.append(
                where + f"| {got['plan']} | {got['predicted_step_s'] * 1e3:.1f} | "
                f"{got['measured_step_s'] * 1e3:.1f} | "
                f"{_ratio(got['measured_step_s'], got['predicted_step_s'])} | "
                f"{got['predicted_memory_bytes'] / GIB:.3g} | "
                f"{got['measured_memory_bytes'] / GIB:.3g} | "
                f"{_ratio(got['measured_memory_bytes'], got['predicted_memory_bytes'])} | {got['memory_source']} |"
            )
    return "\n".join(lines)


def step_details(rows: Sequence[Mapping[str, Any]]) -> str:
    """Every timed step, the estimate's breakdown and the allocator's reserved peak."""
    lines = []
    for row in rows:
        for part in ("program", "eager"):
            got = row.get(part, {})
            if "step_times_s" not in got:
                continue
            times = ", ".join(f"{t * 1e3:.1f}" for t in got["step_times_s"])
            parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in got.get("breakdown_s", {}).items())
            reserved = f"; reserved {got['reserved_bytes'] / GIB:.2f} GiB" if got.get("reserved_bytes") else ""
            lines.append(
                f"- {row['model']} {part}: steps {times} ms (warm-up: the first {row['warmup']}); "
                f"estimate's breakdown ms: {parts or 'none'}{reserved}"
            )
    return "\n".join(lines)


def check_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| check | ok | what was seen | seconds |", "|---|---|---|---:|"]
    for row in rows:
        detail = str(row["detail"]).replace("\n", " ").replace("|", "/")
        lines.append(f"| {row['check']} | {'yes' if row['ok'] else '**no**'} | {detail} | {row['seconds']:.1f} |")
    return "\n".join(lines)


def render(result: Mapping[str, Any]) -> str:
    sections = result["sections"]
    parts = [header(result)]
    operators = sections.get("operators", {}).get("rows")
    if operators:
        parts += ["## Operators", operator_summary(operators), operator_table(operators)]
    steps = sections.get("steps", {}).get("rows")
    if steps:
        parts += ["## Training steps", step_table(steps), step_details(steps)]
    checks = sections.get("cuda_path", {}).get("rows")
    if checks:
        parts += ["## The compiled program's CUDA path", check_table(checks)]
    return "\n\n".join(parts) + "\n"


def save(result: Mapping[str, Any], *, results: Path = RESULTS) -> Path:
    """Write ``results/gpu-DATE.md`` (``gpu-dry-run-DATE.md`` for a dry run), the date of the run."""
    name = f"gpu-{'dry-run-' if result.get('dry_run') else ''}{result['started'][:10]}.md"
    out = results / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(result))
    return out
