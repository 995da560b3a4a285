"""Deterministic work counts of planning: a figure once reached cannot regress unseen (times are noisy, counts not).

Planning speed regressed twice without a failing test (issue 20's choices slowed auto 2–3× at scale; exporting
126 identical layers twice). Each case here plans once in this process with ``jobs=1`` (forked workers would keep
their counts) and counts, by wrapping the functions that do the work:

* ``exported_operators`` — operators ``torch.export`` produced over every export of the planning
  (:func:`planner.ir.capture._capture_export`): a stack of identical layers exported at a few layers
  (:mod:`planner.ir.repeated_layers`) counts those few;
* ``layer_problems`` — the intra-op problems of layers solved (``plan.search.ilp_solves``);
* ``candidates_priced`` — candidates priced exactly on whole stages (:func:`planner.inter.pricing.price_stages`);
* ``simulated_tasks`` — tasks run through the discrete-event simulator (:func:`cost_models.simulator.simulate`).

``tests/test_work_counts.py`` plans the CI cases (``ci=True``) and fails when a count grows past
:data:`GROWTH_LIMIT` × its figure in ``benchmarks/results/work_counts.json``; ``--save`` rewrites that file (every
case, the CI ones and the at-scale ones) after a change that really needs more work, which the diff then shows.

    python -m benchmarks.work_counts [--cases gpt-1.7b-auto,...] [--ci-only] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

from benchmarks.scale_cases import LLAMA_405B, Case, auto_cases, gpt_args, megatron_cases

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "benchmarks" / "results" / "work_counts.json"
GROWTH_LIMIT = 1.5
COUNTS = ("exported_operators", "layer_problems", "candidates_priced", "simulated_tasks")


GPT_1_7B = {"args": gpt_args(24, 2304, 24), "cluster": "dgx-a100", "nodes": 4, "batch": 512}
LLAMA_8B = {**LLAMA_405B, "layers": 32, "hidden": 4096, "heads": 32, "intermediate": 14336}
# planned by tests/test_work_counts.py (seconds each here)
CI_CASES = (
    Case(
        name="gpt-1.7b-megatron", model="examples/gpt.py", method="megatron", degrees=(1, 1, 32), remat="on", **GPT_1_7B
    ),
    Case(name="gpt-1.7b-auto", model="examples/gpt.py", method="auto", **GPT_1_7B),
    Case(
        name="llama-8b-shape-megatron",
        model="examples/zoo/hf_llama.py",
        args=LLAMA_8B,
        cluster="dgx-h100",
        nodes=16,
        batch=256,
        method="megatron",
        degrees=(8, 4, 4),
        remat="on",
    ),
)
# and by this script only: the at-scale rows of benchmarks.search_time --scale whose planning regressed before
AT_SCALE = {"gpt-39b": "auto", "gpt-1008b": "megatron", "llama-405b": "megatron"}
CASES = CI_CASES + tuple(
    replace(case, name=f"{case.name}-{case.method}")
    for case in (*megatron_cases(), *auto_cases())
    if AT_SCALE.get(case.name) == case.method
)


class _Counter:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(COUNTS, 0)

    def wrap(self, key: str, function: Callable, *, amount: Callable | None = None) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            self.counts[key] += amount(args, result) if amount else 1
            return result

        return counted


@contextmanager
def _counting() -> Iterator[_Counter]:
    import cost_models.simulator as simulator
    import planner.costing.lowering as lowering
    import planner.inter.schedule_variants as schedule_variants
    import planner.ir.capture as capture

    counter = _Counter()

    def exported(args: tuple, _: object) -> int:
        return len(args[2].nodes)  # _capture_export(model, inputs, builder): the builder's nodes

    with ExitStack() as stack:
        stack.enter_context(
            mock.patch.object(
                capture,
                "_capture_export",
                counter.wrap("exported_operators", capture._capture_export, amount=exported),
            )
        )
        stack.enter_context(
            mock.patch.object(
                schedule_variants,
                "price_stages",
                counter.wrap("candidates_priced", schedule_variants.price_stages),
            )
        )
        stack.enter_context(
            mock.patch.object(
                lowering, "simulate", counter.wrap("simulated_tasks", simulator.simulate, amount=lambda a, _: len(a[0]))
            )
        )
        yield counter


def count_work(case: Case) -> dict:
    """Plan ``case`` once (``jobs=1``) and return its counts, seconds and what it planned (or its one-line error)."""
    from cost_models.cluster import load_cluster
    from planner.api import plan_model_file
    from planner.errors import AutoplanError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cluster = load_cluster(case.cluster, num_nodes=case.nodes)
    options = {"degrees": case.degrees} if case.degrees else {}
    started = time.perf_counter()
    with _counting() as counter:
        try:
            plan = plan_model_file(
                ROOT / case.model,
                cluster,
                batch_size=case.batch,
                model_args=case.args,
                method=case.method,
                remat=case.remat,
                jobs=1,
                **options,
            )
            counter.counts["layer_problems"] = plan.search.ilp_solves
            outcome = f"{len(plan.stages)} stage(s), {plan.num_microbatches} microbatches"
        except AutoplanError as error:
            outcome = f"error: {str(error).splitlines()[0][:160]}"
    return {**counter.counts, "seconds": round(time.perf_counter() - started, 1), "outcome": outcome}


def compare(found: dict, golden: dict) -> list[str]:
    """Every count past :data:`GROWTH_LIMIT` × its golden figure, in words (empty: none)."""
    grown = []
    for key in COUNTS:
        limit = GROWTH_LIMIT * golden[key]
        if found[key] > max(limit, golden[key] + 1):
            grown.append(f"{key} {found[key]} against {golden[key]} (limit {limit:g})")
    if found["outcome"].startswith("error") != golden["outcome"].startswith("error"):
        grown.append(f"outcome {found['outcome']!r} against {golden['outcome']!r}")
    return grown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.work_counts", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: every case)")
    parser.add_argument("--ci-only", action="store_true", help="only the cases CI plans")
    parser.add_argument("--save", action="store_true", help=f"write the counts to {GOLDEN.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    names = {name.strip() for name in args.cases.split(",")} if args.cases else None
    cases = [c for c in CASES if (names is None or c.name in names) and (c in CI_CASES or not args.ci_only)]
    golden = json.loads(GOLDEN.read_text())["cases"] if GOLDEN.is_file() else {}
    print("| case | exported operators | layer problems | candidates priced | simulated tasks | s | outcome |")
    print("|---|---:|---:|---:|---:|---:|---|")
    found = {}
    for case in cases:
        found[case.name] = count_work(case)
        row = found[case.name]
        was = golden.get(case.name)
        cells = [f"{row[k]}" + (f" (was {was[k]})" if was and was[k] != row[k] else "") for k in COUNTS]
        print(f"| {case.name} | {' | '.join(cells)} | {row['seconds']} | {row['outcome']} |", flush=True)
    if args.save:
        kept = {name: row for name, row in golden.items() if name not in found}
        command = " ".join(["python -m benchmarks.work_counts", *(argv if argv is not None else sys.argv[1:])])
        GOLDEN.write_text(json.dumps({"command": command, "cases": {**kept, **found}}, indent=1) + "\n")
        print(f"wrote {GOLDEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
