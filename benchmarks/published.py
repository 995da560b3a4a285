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
    python -m benchmarks.published --collectives [--rows ...] [--save]

``--before OLD.json`` adds the ratios of an earlier run (``--json-out`` of the code before a change)
as columns, ``--middle`` those of an intermediate one; ``--save`` writes
``benchmarks/results/published-<date>.{md,png}``. The auto table gives each auto plan's MFU beside the best
published for its GPU and model size (:mod:`cost_models.mfu_bounds`), the plan's own sanity note.
``--collectives`` plans nothing: it prices each row's data-parallel gradient all-reduce as a ring and as the
algorithm chosen now (:mod:`benchmarks.published_collectives`); with ``--save``:
``benchmarks/results/published-collectives-<date>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.published_cases import AUTO_VARIANT, V100_BATCH_1GPU, VARIANTS, Row, rows
from benchmarks.published_collectives import __doc__ as collectives_doc
from benchmarks.published_collectives import collectives_table
from benchmarks.published_report import Compared, auto_table, draw, summary, table
from benchmarks.results_page import RESULTS, save_table
from benchmarks.scale_cases import run_case

ROOT = Path(__file__).resolve().parent.parent


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


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip() or "unknown"


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="only price each row's data-parallel all-reduce, ring against the chosen algorithm (no plans)",
    )
    parser.add_argument("--code-note", default="", help="what code ran, for the page (default: commit + tree)")
    parser.add_argument(
        "--from-json", type=Path, help="redraw the page from raw results (--json-out) instead of running"
    )
    return parser


def main() -> None:
    options = _parser().parse_args()
    selected = [row for row in rows() if not options.rows or row.name in options.rows.split(",")]
    variants = options.variants.split(",")
    if options.collectives:
        _print_collectives(selected, save=options.save)
        return
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


def _print_collectives(selected: list[Row], *, save: bool) -> None:
    text = collectives_table(selected)
    print(text)
    if save:
        save_table(
            "published-collectives",
            title="Published rows: each data-parallel all-reduce, ring against the algorithm chosen now",
            command="python -m benchmarks.published " + " ".join(sys.argv[1:]),
            description=f"Code: commit `{_commit()}` plus the working tree. "
            + " ".join((collectives_doc or "").split()),
            table=text,
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
