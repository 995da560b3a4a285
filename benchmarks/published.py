"""Published training runs against our estimate of their own configuration (issue 19).

Every row of ``../shared/published-measurements.md``: the ten Megatron-LM SC'21 rows on DGX A100
(Narayanan et al. 2021, Table 1: :data:`scale_cases.MEGATRON_ROWS`, GPT, seq 2048, vocab 51,200) and
the two Megatron-LM 2019 rows on DGX-2H V100 (Shoeybi et al. 2019: GPT-2 shapes, seq 1024). Each row
is planned as it ran — ``--method megatron --degrees t,p,d --remat on --space alpa --microbatches m --runtime R``
(full recomputation; ``--space alpa`` leaves out what Megatron-LM did not have in 2019–2021: sequence parallelism
(2022) and the distributed optimizer), its batch, its cluster, its microbatch size and its runtime profile
(:mod:`planner.costing.runtime_profiles`) — in a fresh process (:func:`scale_cases.run_case`), and reported as

* measured samples/s: ``TFLOP/s per GPU × GPUs / (F / B)`` with the paper's FLOPs per iteration
  ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` (recomputation counted, Megatron-LM 2021 Eq. 3);
* our estimated samples/s: ``B / estimate.step_time_s`` and ``estimated ÷ measured``;
* ``auto``'s plan for the same model, cluster and batch (shape, recomputation, estimate) beside it.

Each row is estimated on the layer the papers ran (``published``, the headline: attention as separate
operators — ``Q·Kᵀ``, causal mask, softmax, dropout, ``·V``, split by heads under tensor parallelism as
Megatron-LM split it; fused attention kernels came in 2022 — and dropout 0.1) and, for comparison, on
``examples/gpt.py`` as it is (``fused``: ``scaled_dot_product_attention`` priced as FlashAttention, no dropout;
``auto`` plans this one, under our own runtime, which is what its plans would run on).

The SC'21 rows run as SC'21's own scripts ran them (``examples/sc21/run_table_1.sh`` of Megatron-LM ``v2.5``,
:data:`SC21_SCRIPT`): the microbatch size of each row (the microbatch count is ``batch / (microbatch · d)``) and
its ``--DDP-impl`` (``torch``: runtime ``megatron-lm-2021-torch-ddp``, DDP's overlapped buckets, for the rows
without pipelining; ``local``: ``megatron-lm-2021``, one all-reduce after the backward, for the pipelined
ones). Four pipelined rows also ran the interleaved schedule (``--num-layers-per-virtual-pipeline-stage``:
76.1B and 529.6B at 3 virtual stages per rank, 145.6B and 310.1B at 2); the estimate runs 1F1B for them (its
interleaved schedule takes 2 or 4 virtual stages and is outside ``--space alpa``), so it charges them
``(p − 1)/m`` of bubble where they had about ``1/v`` of that. The 2019 rows run ``megatron-lm-2019`` (local
DDP) with one microbatch (the 2019 code had no gradient accumulation).

Choices the papers leave open, stated in the output: the 2019 paper gives no batch for its
single-GPU 1.2B baseline (we take 8, the per-GPU batch of its weak-scaling runs) and does not state
its FLOP formula (we use the 2021 formula, which counts the recomputation; if the 2019 figure
excluded it, measured samples/s would be 4/3 higher and the ratio × 0.75).

    python -m benchmarks.published [--rows gpt-1.7b,...] [--variants published,fused] [--no-auto]
                                   [--timeout-s 300] [--json-out F.json] [--save]
                                   [--before OLD.json --before-commit SHA] [--middle MID.json --middle-label L]
                                   [--from-json RAW.json]   (redraw the page from an earlier run's raw results)

``--before OLD.json`` adds the ratios of an earlier run (``--json-out`` of the code before a change)
as columns, ``--middle`` those of an intermediate one; ``--save`` writes
``benchmarks/results/published-<date>.{md,png}``. The auto table gives each auto plan's MFU beside the best
published for its GPU and model size (:mod:`cost_models.mfu_bounds`), the plan's own sanity note.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results_page import RESULTS, save_table
from benchmarks.scale_cases import MEGATRON_ROWS, Case, run_case

ROOT = Path(__file__).resolve().parent.parent

# TFLOP/s per GPU of each SC'21 row, by parameters (B): published-measurements.md, Table 1 of the paper
A100_TFLOPS = {
    1.7: 137,
    3.6: 138,
    7.5: 142,
    18.4: 135,
    39.1: 138,
    76.1: 140,
    145.6: 148,
    310.1: 155,
    529.6: 163,
    1008.0: 163,
}
# Per SC'21 row, by parameters (B): (microbatch size, --DDP-impl, layers per virtual pipeline stage or None), from
# Megatron-LM v2.5 examples/sc21/run_table_1.sh (MBS, DDP, --num-layers-per-virtual-pipeline-stage)
SC21_SCRIPT = {
    1.7: (16, "torch", None),
    3.6: (16, "torch", None),
    7.5: (16, "torch", None),
    18.4: (8, "torch", None),
    39.1: (4, "local", None),
    76.1: (2, "local", 5),
    145.6: (2, "local", 5),
    310.1: (1, "local", 3),
    529.6: (1, "local", 1),
    1008.0: (1, "local", None),
}
RUNTIME_OF_DDP = {"torch": "megatron-lm-2021-torch-ddp", "local": "megatron-lm-2021"}
A100_SEQ, V100_SEQ, VOCAB = 2048, 1024, 51200
V100_BATCH_1GPU = 8  # unstated in the paper for this row: the per-GPU batch of its scaling runs (8 × 64 = 512)
BAND, MOONSHOT = 0.15, 0.10
# examples/gpt.py model arguments of each version of the model (see the module docstring)
VARIANTS = {"published": {"attention": "unfused", "dropout": 0.1}, "fused": {}}
AUTO_VARIANT = "fused"  # auto plans examples/gpt.py as it is, under our own runtime


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    degrees: tuple[int, int, int]  # (t, p, d)
    gpus: int
    batch: int
    seq: int
    cluster: str
    tflops_per_gpu: float  # published
    source: str
    micro_batch: int  # per data-parallel replica and microbatch (SC'21's script; the 2019 rows: their batch per GPU)
    runtime: str  # planner.costing.runtime_profiles
    virtual_stages: int = 1  # the interleaved schedule's stages per rank it ran (the estimate runs 1F1B)
    note: str = ""

    @property
    def flops_per_iteration(self) -> float:
        """Megatron-LM 2021 Eq. 3 (counts the recomputation's extra forward)."""
        b, s, l, h = self.batch, self.seq, self.layers, self.hidden  # noqa: E741
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))

    @property
    def measured_samples_s(self) -> float:
        return self.tflops_per_gpu * 1e12 * self.gpus / (self.flops_per_iteration / self.batch)

    def case(self, method: str, *, variant: str) -> Case:
        per_node = 16 if self.cluster == "dgx-2h" else 8
        nodes, devices_per_node = (1, self.gpus) if self.gpus < per_node else (self.gpus // per_node, None)
        args = {
            "size": "39b",
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "seq": self.seq,
            "vocab": VOCAB,
            **VARIANTS[variant],
        }
        fixed = method == "megatron"
        return Case(
            name=f"{self.name}-{variant}",
            model="examples/gpt.py",
            args=args,
            cluster=self.cluster,
            nodes=nodes,
            batch=self.batch,
            method=method,
            degrees=self.degrees if fixed else None,
            remat="on" if fixed else "auto",
            devices_per_node=devices_per_node,
            space="alpa" if fixed else "full",
            microbatches=self.microbatches if fixed else None,
            runtime=self.runtime if fixed else "autoplan",
        )

    @property
    def microbatches(self) -> int:
        return self.batch // (self.micro_batch * self.degrees[2])


def rows() -> list[Row]:
    found = []
    for params, heads, hidden, layers, t, p, gpus, batch in MEGATRON_ROWS:
        micro_batch, ddp, per_virtual = SC21_SCRIPT[params]
        found.append(
            Row(
                name=f"gpt-{params:g}b",
                params_b=params,
                heads=heads,
                hidden=hidden,
                layers=layers,
                degrees=(t, p, gpus // (t * p)),
                gpus=gpus,
                batch=batch,
                seq=A100_SEQ,
                cluster="dgx-a100",
                tflops_per_gpu=A100_TFLOPS[params],
                source="Megatron-LM SC'21, Table 1",
                micro_batch=micro_batch,
                runtime=RUNTIME_OF_DDP[ddp],
                virtual_stages=layers // p // per_virtual if per_virtual else 1,
            )
        )
    found.append(
        Row(
            name="gpt-1.2b-v100",
            params_b=1.2,
            heads=16,
            hidden=1536,
            layers=40,
            degrees=(1, 1, 1),
            gpus=1,
            batch=V100_BATCH_1GPU,
            seq=V100_SEQ,
            cluster="dgx-2h",
            tflops_per_gpu=39.0,
            source="Megatron-LM 2019, single-GPU baseline",
            micro_batch=V100_BATCH_1GPU,
            runtime="megatron-lm-2019",
            note=f"batch {V100_BATCH_1GPU} assumed (unstated)",
        )
    )
    found.append(
        Row(
            name="gpt-8.3b-v100",
            params_b=8.3,
            heads=32,
            hidden=3072,
            layers=72,
            degrees=(8, 1, 64),
            gpus=512,
            batch=512,
            seq=V100_SEQ,
            cluster="dgx-2h",
            tflops_per_gpu=15.1e3 / 512,
            source="Megatron-LM 2019, 15.1 PFLOP/s on 512 GPUs",
            micro_batch=8,
            runtime="megatron-lm-2019",
        )
    )
    return found


def plan_summary(plan_json: dict) -> dict:
    """Shape (familiar degrees), step seconds and MFU of a plan JSON, read with the planner's own code."""
    from planner.plan.shape import plan_shape
    from planner.plan.value import Plan

    plan = Plan.from_json(plan_json)
    estimate = plan_json["estimate"]
    return {
        "shape": plan_shape(plan),
        "step_s": estimate["step_time_s"],
        "mfu": estimate.get("mfu"),
        "breakdown_s": estimate.get("breakdown_s", {}),
        "runtime": plan.runtime,
        "mfu_note": any(note.startswith("estimated MFU") for note in plan.notes),
    }


def run_row(row: Row, *, method: str, variant: str, timeout_s: float, scratch: Path) -> dict:
    result = run_case(row.case(method, variant=variant), timeout_s=timeout_s, scratch=scratch)
    found = {"wall_s": result.get("wall_s")}
    if "error" in result:
        return {**found, "error": result["error"]}
    summary = plan_summary(result["plan"])
    return {**found, **summary, "samples_s": row.batch / summary["step_s"]}


def measure(selected: list[Row], *, variants: list[str], auto: bool, timeout_s: float) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for row in selected:
            entry: dict = {"row": row.name, "measured_samples_s": row.measured_samples_s, "runs": {}}
            for variant in variants:
                entry["runs"][variant] = run_row(
                    row, method="megatron", variant=variant, timeout_s=timeout_s, scratch=Path(scratch)
                )
            if auto:
                entry["auto"] = run_row(
                    row, method="auto", variant=AUTO_VARIANT, timeout_s=timeout_s, scratch=Path(scratch)
                )
            results.append(entry)
            print(json.dumps(entry), file=sys.stderr, flush=True)
    return results


def load_runs(path: Path) -> dict[str, dict]:
    """Row name -> variant -> run of a saved ``--json-out`` (a file without variants holds ``fused`` runs)."""
    found = {}
    for entry in json.loads(path.read_text())["results"]:
        found[entry["row"]] = entry.get("runs") or {"fused": entry["megatron"]}
    return found


def _ratio(run: dict | None, measured: float) -> float | None:
    if not run or "samples_s" not in run:
        return None
    return run["samples_s"] / measured


def _cell(value: float | None, digits: str = ".2f") -> str:
    return "" if value is None else format(value, digits)


def _marked(ratio: float | None) -> str:
    """The ratio, bold when outside ±15%."""
    if ratio is None:
        return "—"
    text = f"{ratio:.2f}"
    return text if abs(ratio - 1) <= BAND else f"**{text}**"


@dataclass(frozen=True, kw_only=True)
class Compared:
    """Runs of earlier code to show beside: label -> row name -> variant -> run."""

    columns: dict[str, dict[str, dict]]

    def ratio(self, label: str, row: Row, variant: str, measured: float) -> float | None:
        return _ratio(self.columns[label].get(row.name, {}).get(variant), measured)


def table(selected: list[Row], results: list[dict], compared: Compared, *, variant: str) -> str:
    """One row per published run: measured, our estimate of ``variant`` now and under the compared code."""
    labels = list(compared.columns)
    head = (
        "| row | GPUs | cluster | (t, p, d) | batch | runtime | measured TFLOP/s/GPU | measured samples/s | "
        "estimated samples/s "
    )
    head += "| **est ÷ measured** | " + "".join(f"{label} | " for label in labels) + "plan |"
    lines = [head, "|---|---:|---|---|---:|---|---:|---:|---:|---:|" + "---:|" * len(labels) + "---|"]
    for row, entry in zip(selected, results, strict=True):
        if variant not in entry["runs"]:
            continue
        measured, run = entry["measured_samples_s"], entry["runs"][variant]
        estimated = _cell(run.get("samples_s"), ".1f")
        earlier = "".join(f"{_marked(compared.ratio(label, row, variant, measured))} | " for label in labels)
        name = f"{row.name} ({row.note})" if row.note else row.name
        lines.append(
            f"| {name} | {row.gpus} | {row.cluster} | {','.join(map(str, row.degrees))} | {row.batch} | "
            f"{run.get('runtime', row.runtime)} | {row.tflops_per_gpu:.1f} | {measured:.1f} | {estimated} | "
            f"{_marked(_ratio(run, measured))} | {earlier}{_shape(run, row)} |"
        )
    return "\n".join(lines)


def _shape(run: dict, row: Row) -> str:
    """The plan's shape, and the interleaving the row ran where the estimate runs 1F1B."""
    shape = run.get("shape", run.get("error", ""))
    return shape + (
        f" (ran interleaved, {row.virtual_stages} virtual stages per rank)" if row.virtual_stages > 1 else ""
    )


def auto_table(selected: list[Row], results: list[dict], *, variant: str) -> str:
    """``auto``'s plan (our runtime) beside the published configuration (``variant`` under its runtime), same
    model, cluster and batch; auto's MFU beside the best published for its GPU and model size."""
    from cost_models.mfu_bounds import published_bound

    lines = [
        "| row | published configuration: estimated samples/s | auto's plan | auto's estimate, samples/s | "
        "auto ÷ measured | auto ÷ published configuration (estimates) | auto's MFU | best published MFU "
        "(cost_models.mfu_bounds) | noted as above it |",
        "|---|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for row, entry in zip(selected, results, strict=True):
        fixed, auto = entry["runs"].get(variant, {}), entry.get("auto") or {"error": "not run"}
        rate = auto.get("samples_s")
        gain = rate / fixed["samples_s"] if rate and fixed.get("samples_s") else None
        bound = published_bound("A100" if row.cluster == "dgx-a100" else "V100", row.params_b * 1e9)
        best = f"{bound.mfu:.1%} ({bound.source})" if bound else ""
        mfu = _cell(auto.get("mfu"), ".1%")
        noted = "" if "mfu_note" not in auto else ("yes" if auto["mfu_note"] else "no")
        lines.append(
            f"| {row.name} | {_cell(fixed.get('samples_s'), '.1f')} | {auto.get('shape', auto.get('error', ''))} | "
            f"{_cell(rate, '.1f')} | {_cell(_ratio(auto, entry['measured_samples_s']))} | {_cell(gain)} | {mfu} | "
            f"{best} | {noted} |"
        )
    return "\n".join(lines)


def counts(ratios: list[float | None]) -> str:
    found = [r for r in ratios if r is not None]
    inside = sum(abs(r - 1) <= BAND for r in found)
    moon = sum(abs(r - 1) <= MOONSHOT for r in found)
    worst = max(found, key=lambda r: abs(r - 1)) if found else None
    return f"{inside} of {len(found)} rows within ±15%, {moon} within ±10%, worst {_cell(worst)}"


def summary(selected: list[Row], results: list[dict], compared: Compared, *, variants: list[str]) -> str:
    lines = []
    for variant in variants:
        shown = [(r, e) for r, e in zip(selected, results, strict=True) if variant in e["runs"]]
        now = [_ratio(e["runs"][variant], e["measured_samples_s"]) for _, e in shown]
        text = f"`{variant}`: estimated ÷ measured now: {counts(now)}"
        for label in compared.columns:
            old = [compared.ratio(label, r, variant, e["measured_samples_s"]) for r, e in shown]
            text += f"; {label}: {counts(old)}"
        lines.append(text + ".")
    return "\n".join(f"- {line}" for line in lines)


def draw(selected: list[Row], results: list[dict], compared: Compared, *, variants: list[str], path: Path) -> None:
    """Estimated ÷ measured per row (each variant now, the compared code, auto's estimate) with the ±15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.atomic_file import save_figure_atomic

    figure, axis = plt.subplots(figsize=(11, 4.6))
    xs = list(range(len(selected)))
    axis.axhspan(1 - BAND, 1 + BAND, color="tab:green", alpha=0.12, label="±15% (target)")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    measured = [e["measured_samples_s"] for e in results]
    series = []
    for variant, marker, hollow in zip(variants, "oD", "x+", strict=False):
        now = [_ratio(e["runs"].get(variant), m) for e, m in zip(results, measured, strict=True)]
        series.append((f"{variant}, now", now, marker, None))
        for label in compared.columns:
            ratios = [
                compared.ratio(label, r, variant, m) if y is not None else None
                for r, m, y in zip(selected, measured, now, strict=True)
            ]
            series.append((f"{variant}, {label}", ratios, hollow, None))
    auto = [_ratio(e.get("auto"), m) for e, m in zip(results, measured, strict=True)]
    series.append((f"auto's own plan ({AUTO_VARIANT}, our runtime)", auto, "s", "none"))
    for label, ratios, marker, face in series:
        points = [(x, y) for x, y in zip(xs, ratios, strict=True) if y is not None]
        if points:
            axis.scatter(
                *zip(*points, strict=True),
                marker=marker,
                label=label,
                facecolors=face,
                edgecolors="tab:purple" if face else None,
            )
    axis.set_xticks(xs, [row.name for row in selected], rotation=35, ha="right", fontsize=8)
    axis.set(ylabel="estimated ÷ measured throughput", title="Published Megatron-LM runs against our estimate")
    axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    try:
        save_figure_atomic(figure, path)
    finally:
        plt.close(figure)


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="only these rows, by name (gpt-1.7b, gpt-8.3b-v100, ...)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="model versions to estimate (see VARIANTS)")
    parser.add_argument("--no-auto", action="store_true", help="skip auto's plan beside each row")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="seconds per plan before it is stopped")
    parser.add_argument("--json-out", type=Path, help="write the raw results here")
    parser.add_argument("--before", type=Path, help="raw results (--json-out) of the code before a change")
    parser.add_argument("--before-commit", default="", help="the commit --before was run on, for the page")
    parser.add_argument("--middle", type=Path, help="raw results (--json-out) of an intermediate version")
    parser.add_argument("--middle-label", default="middle", help="its column's name")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/published-<date>.{md,png}")
    parser.add_argument("--code-note", default="", help="what code ran, for the page (default: commit + tree)")
    parser.add_argument(
        "--from-json", type=Path, help="redraw the page from raw results (--json-out) instead of running"
    )
    options = parser.parse_args()
    selected = [row for row in rows() if not options.rows or row.name in options.rows.split(",")]
    variants = options.variants.split(",")
    load_before = os.getloadavg()[0]
    if options.from_json:
        results = json.loads(options.from_json.read_text())["results"]
    else:
        results = measure(selected, variants=variants, auto=not options.no_auto, timeout_s=options.timeout_s)
    if options.json_out:
        options.json_out.write_text(json.dumps({"commit": _commit(), "results": results}, indent=1))
    columns = {}
    if options.before:
        columns["before"] = load_runs(options.before)
    if options.middle:
        columns[options.middle_label] = load_runs(options.middle)
    compared = Compared(columns=columns)
    sections = [
        f"### `{variant}`: {VARIANT_TEXT[variant]}\n\n" + table(selected, results, compared, variant=variant)
        for variant in variants
    ]
    if not options.no_auto:
        sections.append(
            f"### auto (`{AUTO_VARIANT}`, our runtime) beside the published configuration (`{variants[0]}`)\n\n"
            + auto_table(selected, results, variant=variants[0])
        )
    text = "\n\n".join(sections)
    print(text)
    print(summary(selected, results, compared, variants=variants))
    if options.save:
        command = "python -m benchmarks.published " + " ".join(sys.argv[1:])
        description = (
            _description(options, load_before=load_before)
            + "\n\n"
            + summary(selected, results, compared, variants=variants)
        )
        save_table(
            "published",
            title="Published training runs against our estimates",
            command=command,
            description=description,
            table=text,
        )
        draw(
            selected, results, compared, variants=variants, path=RESULTS / f"published-{time.strftime('%Y-%m-%d')}.png"
        )


VARIANT_TEXT = {
    "fused": "examples/gpt.py as it is (fused scaled_dot_product_attention priced as FlashAttention, no dropout), "
    "same runtime and microbatches",
    "published": "the layer the papers ran (attention as separate operators split by heads, dropout 0.1), under "
    "the row's runtime and microbatch size: the target",
}


def _description(options: argparse.Namespace, *, load_before: float) -> str:
    earlier = ""
    if options.before:
        earlier += (
            f" Column *before*: the same rows on commit `{options.before_commit}`, which planned them with the "
            "planner's own microbatch count and our runtime, the t > 1 rows on the fused model only."
        )
    if options.middle:
        earlier += f" Column *{options.middle_label}*: an intermediate run (see the command)."
    return (
        f"Code: {options.code_note or f'commit `{_commit()}` plus the working tree'}. "
        f"Load average (1 min) {load_before:.2f} at the start. "
        "Each plan runs in a fresh process (`plan ... --json --jobs 2`, roofline costs, adam-mixed). *Estimated*: "
        "our estimate of the row's own configuration as it ran: `--method megatron --degrees t,p,d --remat on "
        "--space alpa --microbatches m --runtime R`, its batch and cluster; the microbatch size and `--DDP-impl` of "
        "each SC'21 row from SC'21's own script (Megatron-LM v2.5 `examples/sc21/run_table_1.sh`: runtime "
        "`megatron-lm-2021-torch-ddp` for `torch`, `megatron-lm-2021` for `local`); the 2019 rows under "
        "`megatron-lm-2019`, one microbatch. The runtime profiles are `planner/costing/runtime_profiles.py`. Four "
        "pipelined rows ran the interleaved schedule, which the estimate does not (it runs 1F1B): the plan column "
        "says which. *Measured samples/s* = published TFLOP/s per GPU × GPUs ÷ (FLOPs per iteration ÷ batch), FLOPs "
        "per iteration `96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))` (Megatron-LM 2021 Eq. 3, recomputation counted). The "
        f"2019 V100 rows: the single-GPU 1.2B baseline's batch is not given; we take {V100_BATCH_1GPU} (the per-GPU "
        "batch of the paper's scaling runs); the 2019 paper's FLOP counting is not stated, we apply the same formula "
        "(if it excluded the recomputation the measured rate is 4/3 higher and the ratio × 0.75). Ratios outside "
        "±15% are bold. Two versions of the model: `published` is the layer the papers ran (attention as separate "
        "operators, split by heads under tensor parallelism: fused attention kernels came in 2022; dropout 0.1), the "
        "target; `fused` is examples/gpt.py as it is, for comparison. *auto*: `--method auto` on the fused model, "
        "same cluster and batch, under our own runtime (what its plan would run on), its own plan and estimate; its "
        f"MFU beside the best published for the GPU and model size.{earlier}"
    )


if __name__ == "__main__":
    main()
