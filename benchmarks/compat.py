"""Compatibility sweep: every zoo family x method x world x batch -> plan, run two steps, check parity.

Usage (the whole sweep, a few hours on the 2-core machine; see docs/compatibility.md for the last):

    python -m benchmarks.compat --out docs/compatibility.md
    python -m benchmarks.compat --families nn_lstm,hf_gpt2 --methods auto,megatron --worlds 2 --batch-sizes 8

For each batch size (``--batch-sizes``, 4 and 8: a microbatch split or a replica's share that works at one
batch may not at the other), family (``examples/zoo/*.py``; files starting with ``_`` are shared helpers) and
world size a fresh process captures the model once (:func:`planner.api.prepare_model_file`, cluster
``local-cpu`` with one node of ``world`` processes) and plans every method
from that capture (:func:`planner.api.plan_prepared`) and the plan runs for ``--steps`` steps with ``--check-parity``:
the program ``plan compile`` writes (the one ``plan run`` launches) under torchrun, one process per
device — ``plan run`` without its preflight capture, which the sweep has just done. A cell reads:

* ``✓`` — the run finished and both steps matched one device (loss and every gradient by name);
* ``refused: ...`` — planning said why the plan cannot be run exactly (a user-facing error);
* ``INTERNAL: ...`` — planning hit a bug of ours (any exception that is not a user-facing error);
* ``MISMATCH: ...`` — the run finished but parity failed: a wrong result;
* ``failed: ...`` — a rank failed; ``hang`` — the run outlived ``--timeout-s`` plus a margin.

Every cell's outcome, its plan's shape, seconds and the commit it ran at go to ``--json``; ``--out``
writes the markdown table (one row per family and batch, one cell per method x world). Both are rewritten after
every family, so an interrupted sweep keeps what it did; ``--resume OLD.json`` keeps the cells that
passed in an earlier sweep and runs the others again (the table counts every cell either way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "examples" / "zoo"
METHODS = ("auto", "data-parallel", "megatron", "uniform-pipeline", "hash")
WORLDS = (2, 4)
BATCH_SIZES = (4, 8)
RUN_MARGIN_S = 60.0  # start-up of the ranks (imports, capture) on top of the collective timeout


@dataclass(frozen=True, kw_only=True)
class Cell:
    family: str
    method: str
    world: int
    outcome: str  # "ok", "refused", "internal", "mismatch", "failed", "hang"
    message: str
    plan_s: float
    run_s: float
    shape: str = ""
    commit: str = ""
    batch: int = 8  # the global batch (sweeps before there were two ran at 8)

    @property
    def text(self) -> str:
        if self.outcome == "ok":
            return "✓"
        label = {
            "refused": "refused",
            "internal": "INTERNAL",
            "mismatch": "MISMATCH",
            "failed": "failed",
            "hang": "hang",
        }[self.outcome]
        return f"{label}: {self.message}" if self.message else label


def families(selected: str | None) -> list[Path]:
    files = sorted(path for path in ZOO.glob("*.py") if not path.name.startswith("_"))
    if selected:
        wanted = [name.strip() for name in selected.split(",") if name.strip()]
        unknown = [name for name in wanted if not (ZOO / f"{name}.py").is_file()]
        if unknown:
            raise SystemExit(f"compat: no zoo family {unknown[0]} (files in {ZOO})")
        files = [ZOO / f"{name}.py" for name in wanted]
    return files


def sweep_family(path: Path, *, methods: list[str], world: int, batch: int, args: argparse.Namespace) -> list[Cell]:
    """Plan every method in a fresh process (as a user's ``plan`` command would: no state left by other
    families' captures), then run each plan."""
    from planner.plan import load_plan

    cells = []
    with tempfile.TemporaryDirectory(prefix="autoplan-compat-plans-") as directory:
        command = [
            sys.executable,
            "-m",
            "benchmarks.compat",
            "--plan-family",
            str(path),
            "--worlds",
            str(world),
            "--methods",
            ",".join(methods),
            "--batch-sizes",
            str(batch),
            "--plans-dir",
            directory,
        ]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=1800)
        listing = Path(directory) / "planned.json"
        if done.returncode != 0 or not listing.is_file():
            last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
            planned = [
                {"method": m, "outcome": "internal", "message": f"planning crashed: {last[0]}", "plan_s": 0.0}
                for m in methods
            ]
        else:
            planned = json.loads(listing.read_text())
        for record in planned:
            common = {"family": path.stem, "method": record["method"], "world": world, "batch": batch}
            if record["outcome"]:
                cell = Cell(
                    **common, outcome=record["outcome"], message=record["message"], plan_s=record["plan_s"], run_s=0
                )
            else:
                cell = run_cell(load_plan(record["plan_file"]), common=common, plan_s=record["plan_s"], args=args)
            cells.append(cell)
            where = f"world {world} batch {batch}"
            print(f"  {path.stem:28s} {record['method']:17s} {where}: {cell.text[:100]}", flush=True)
    return cells


def plan_family(path: Path, *, methods: list[str], world: int, batch_size: int, out_dir: Path) -> list[dict]:
    """Capture once and plan every method; each plan saved as ``out_dir/METHOD.json``."""
    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.errors import AutoplanError
    from planner.plan import save_plan

    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=world)
    started = time.perf_counter()
    try:
        prepared = prepare_model_file(path, cluster, batch_size=batch_size)
        error = None
    except AutoplanError as failure:
        error = ("refused", f"capture: {_first_line(failure)}")
    except Exception as failure:  # a bug of ours: the sweep reports it and goes on
        error = ("internal", f"capture: {type(failure).__name__}: {_first_line(failure)}")
    capture_s = time.perf_counter() - started
    records = []
    for method in methods:
        if error is not None:
            records.append({"method": method, "outcome": error[0], "message": error[1], "plan_s": capture_s})
            continue
        started = time.perf_counter()
        record = {"method": method, "outcome": "", "message": ""}
        try:
            plan_file = out_dir / f"{method}.json"
            save_plan(plan_prepared(prepared, method), plan_file)
            record["plan_file"] = str(plan_file)
        except AutoplanError as failure:
            record.update(outcome="refused", message=_first_line(failure))
        except Exception as failure:
            record.update(outcome="internal", message=f"{type(failure).__name__}: {_first_line(failure)}")
        records.append({**record, "plan_s": time.perf_counter() - started})
    return records


def run_cell(plan, *, common: dict, plan_s: float, args: argparse.Namespace) -> Cell:
    from executors.training.launch import torchrun_argv
    from executors.training.program import write_program

    shape = f"{len(plan.stages)} stage(s) {[list(s.mesh_shape) for s in plan.stages]} m={plan.num_microbatches}"
    with tempfile.TemporaryDirectory(prefix="autoplan-compat-") as directory:
        program = write_program(plan, Path(directory))  # what `plan run` launches, without its preflight
        command = torchrun_argv(
            world=plan.cluster.num_devices,
            program=program,
            args=["--steps", args.steps, "--check-parity", "--timeout-s", args.timeout_s],
        )
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=args.timeout_s + RUN_MARGIN_S
            )
        except subprocess.TimeoutExpired:
            return Cell(
                **common,
                outcome="hang",
                message=f"no result after {args.timeout_s + RUN_MARGIN_S:.0f} s",
                plan_s=plan_s,
                run_s=time.perf_counter() - started,
                shape=shape,
            )
    run_s = time.perf_counter() - started
    outcome, message = judge(done, steps=args.steps)
    return Cell(**common, outcome=outcome, message=message, plan_s=plan_s, run_s=run_s, shape=shape)


def judge(done: subprocess.CompletedProcess, *, steps: int) -> tuple[str, str]:
    steps_seen = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    mismatches = [line for line in steps_seen if "MISMATCH" in line]
    if mismatches:
        return "mismatch", mismatches[0].split("parity MISMATCH:", 1)[-1].strip()
    if done.returncode == 0 and len(steps_seen) == steps and all("parity match" in line for line in steps_seen):
        return "ok", ""
    lines = [re.sub(r"^\[rank\d+\]:", "", line) for line in done.stderr.splitlines() if line.strip()]
    ranks = [line for line in lines if line.startswith("rank ")]
    causes = [line for line in ranks if "closed by peer" not in line] or ranks  # a peer's crash is not the cause
    first = causes[0] if causes else _launcher_summary(lines) or f"exit code {done.returncode}"
    if "timed out" in first.lower() or "timeout" in first.lower():
        return "hang", first
    return "failed", first


def _launcher_summary(lines: list[str]) -> str:
    """torchrun's root cause when no rank said why (a rank killed by a signal): its rank, exit code and cause."""
    fields = {}
    for line in lines:
        key, sep, value = line.strip().partition(":")
        if sep and key.strip() in ("rank", "exitcode", "traceback") and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if not fields:
        return lines[-1] if lines else ""
    return "launcher: " + ", ".join(f"{key} {value}" for key, value in fields.items())


def _env() -> dict[str, str]:
    """The runs import this checkout (not whatever ``pip install -e`` points at)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # PYTHONHASHSEED: one string-hash order for the planning process and the ranks (ModernBERT builds its
    # rotary embeddings by iterating a set of strings, so its graph's order follows the hash seed)
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": path,
        "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0"),
    }


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    return done.stdout.strip() + ("+dirty" if dirty else "")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def markdown(cells: list[Cell], *, methods: list[str], worlds: list[int], header: str) -> str:
    columns = [(method, world) for method in methods for world in worlds]
    by_key = {(c.family, c.batch, c.method, c.world): c for c in cells}
    rows = sorted(dict.fromkeys((c.family, c.batch) for c in cells))
    several = len({batch for _, batch in rows}) > 1
    passed = sum(c.outcome == "ok" for c in cells)
    lines = [header, "", f"**{passed} of {len(cells)} cells pass** ({100 * passed / max(len(cells), 1):.1f}%).", ""]
    lines.append("| family | " + " | ".join(f"{m} ×{w}" for m, w in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for name, batch in rows:
        row = [_cell_text(by_key.get((name, batch, m, w))) for m, w in columns]
        label = f"{name} (batch {batch})" if several else name
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _cell_text(cell: Cell | None) -> str:
    if cell is None:
        return "—"
    return cell.text.replace("|", "\\|")[:160]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", help="comma-separated zoo file stems (default: every file in examples/zoo)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods (default: %(default)s)")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes (default: %(default)s)")
    parser.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="global batch sizes, each a sweep of its own (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="plan run --timeout-s (default %(default)s)")
    parser.add_argument("--out", type=Path, help="write the markdown table here (e.g. docs/compatibility.md)")
    parser.add_argument("--json", type=Path, help="write every cell as JSON here")
    parser.add_argument("--resume", type=Path, help="an earlier --json: keep its passing cells, run the rest")
    parser.add_argument("--plan-family", type=Path, help=argparse.SUPPRESS)  # internal: one family's planning
    parser.add_argument("--plans-dir", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.plan_family is not None:
        records = plan_family(
            args.plan_family, methods=methods, world=worlds[0], batch_size=batches[0], out_dir=args.plans_dir
        )
        (args.plans_dir / "planned.json").write_text(json.dumps(records))
        return 0
    kept = _passed_before(args.resume)
    commit = _commit()
    started = time.perf_counter()
    cells: list[Cell] = []
    command = "python -m benchmarks.compat " + " ".join(argv if argv is not None else sys.argv[1:])
    # every family at the smaller world and batch first: a cut-short sweep stays balanced
    for batch, world in [(batch, world) for batch in batches for world in worlds]:
        for path in families(args.families):
            todo = [m for m in methods if (path.stem, m, world, batch) not in kept]
            cells.extend(kept[(path.stem, m, world, batch)] for m in methods if m not in todo)
            if todo:
                fresh = sweep_family(path, methods=todo, world=world, batch=batch, args=args)
                cells.extend(replace(cell, commit=commit) for cell in fresh)
            _write(
                cells, args=args, methods=methods, worlds=worlds, command=command, wall_s=time.perf_counter() - started
            )
    passed = sum(c.outcome == "ok" for c in cells)
    print(f"{passed} of {len(cells)} cells pass; wall {time.perf_counter() - started:.0f} s", flush=True)
    return 0 if passed == len(cells) else 1


def _passed_before(path: Path | None) -> dict[tuple[str, str, int, int], Cell]:
    if path is None:
        return {}
    cells = [Cell(**cell) for cell in json.loads(path.read_text())["cells"]]
    return {(c.family, c.method, c.world, c.batch): c for c in cells if c.outcome == "ok"}


def _write(
    cells: list[Cell], *, args: argparse.Namespace, methods: list[str], worlds: list[int], command: str, wall_s: float
) -> None:
    if args.out:
        header = _header(command=command.strip(), wall_s=wall_s, commits=sorted({c.commit for c in cells}))
        args.out.write_text(markdown(cells, methods=methods, worlds=worlds, header=header))
    if args.json:
        args.json.write_text(
            json.dumps({"command": command, "wall_s": wall_s, "cells": [asdict(c) for c in cells]}, indent=1)
        )


def _header(*, command: str, wall_s: float, commits: list[str]) -> str:
    import platform

    import torch

    return "\n".join(
        [
            "# Compatibility",
            "",
            "Every model family of `examples/zoo/` planned by each method on `local-cpu` with 2 and 4 CPU ranks "
            "(gloo) at each global batch of the command, "
            "run for two steps with `plan run --check-parity`: loss and every gradient by name against one process. "
            "✓ = both steps match; otherwise the first line of what went wrong (`refused:` is a plan refused at "
            "planning time with its reason; `MISMATCH` would be a wrong result). See `benchmarks/compat.py`.",
            "",
            f"Made {time.strftime('%Y-%m-%d')} on {platform.node()} ({os.cpu_count()} cores, "
            f"torch {torch.__version__}) "
            f"with `{command}` in {wall_s / 60:.1f} min, at commit {', '.join(commits)}.",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
