"""The GPU check: operator times, training steps and peak memory on one GPU against the cost model.

Three sections, each with its own share of the time budget and its own failure (one that raises is
recorded and the next one runs), written to ``OUT/gpu_check.json`` after every section (every measurement
with its prediction beside it) with a log in ``OUT/gpu_check.log``:

* ``operators`` — GEMM (forward, and the backward's two GEMMs), fused attention (SDPA flash, forward and
  backward), LayerNorm and RMSNorm at GPT-350M, GPT-1.3B and Llama-3-8B shapes in bf16, against the operator
  model of the device (:mod:`gpu_check_ops`);
* ``cuda_path`` — the compiled program at world 1: nccl init, DCP checkpoints, resume, ``--check-parity``
  (:func:`gpu_check_steps.cuda_path_rows`);
* ``steps`` — one training step of GPT-350M and GPT-1.3B (bf16 ``adam-mixed``, batch 8 × 1024) planned on
  the device, compiled and launched with torchrun, against the plan's step time and memory estimate; and
  the same step in a plain loop against the closed-form estimate (:func:`gpu_check_steps.step_rows`).

The device is priced as :func:`gpu_check_device.cluster_for` says (H100 preset; H200 built from its data
sheet). ``--dry-run`` runs every section on the CPU with tiny shapes and gloo (the same code, tests/test_gpu_check.py).

    python -m benchmarks.gpu_check --out DIR [--dry-run] [--budget-s 400] [--sections operators,cuda_path,steps]
    python -m benchmarks.gpu_check --report DIR [--save]      (the page; --save: benchmarks/results/gpu-DATE.md)

**On a lent GPU** (see ../shared/GPU.md): planning needs highspy and pulp, which the GPU machine lacks, so
download their wheels here first (Python 3.12 wheels; the versions installed here)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl highspy==1.16.0
    python3 -m pip download --no-deps -d .whl pulp==3.3.2

then make ONE device call: the ``run`` tool with ``timeout_s`` 480, ``carry`` ``[".whl"]`` and the one-line
command :data:`DEVICE_COMMAND` (``python -m benchmarks.gpu_check --device-call`` prints all three): it installs
the wheels into /tmp/site (or, if pip fails there, unpacks them with zipfile, which is what installing a wheel
is), puts them on the path and runs ``python3 -m benchmarks.gpu_check --out $OUT``.
Its files (``gpu_check.json``, ``gpu_check.log``, ``log``) come back under the reply's ``files_at``; then
``python -m benchmarks.gpu_check --report FILES_AT --save`` writes the page. If the wheels do not install,
the program rows say planning failed and the eager rows still measure; rerun only what failed with
``--sections``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from benchmarks.gpu_check_program import Context

SECTIONS = ("operators", "cuda_path", "steps")
SHARES = {"operators": 0.15, "cuda_path": 0.25, "steps": 0.6}  # of the budget left when the section starts
DRY_RUN_GPU = "NVIDIA H100 80GB HBM3"
WHEELS = ".whl"
DEVICE_COMMAND = (
    f"set -o pipefail; (python3 -m pip install -q --no-index --no-deps --target /tmp/site {WHEELS}/*.whl || python3 -c "
    f"\"import glob,zipfile; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('{WHEELS}/*.whl')]\") "
    "2>&1 | tail -3; export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1; "
    "python3 -m benchmarks.gpu_check --out $OUT 2>&1 | tee $OUT/log"
)
DEVICE_TIMEOUT_S = 480


@dataclass(frozen=True, kw_only=True)
class Section:
    name: str
    share: float
    run: Callable[[float], list[dict[str, Any]]]  # deadline (time.monotonic) -> rows


class Log:
    """Timestamped lines on stderr and in the log file."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.started = out, time.monotonic()

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f} s] {message}"
        print(line, file=sys.stderr, flush=True)
        print(line, file=self.out, flush=True)


def run_sections(
    sections: Sequence[Section],
    *,
    budget_s: float,
    result: dict[str, Any],
    save_result: Callable[[], None],
    log: Callable[[str], None],
) -> None:
    """Run each section by its deadline; record status, seconds, error and rows; save after each."""
    end = time.monotonic() + budget_s
    for index, section in enumerate(sections):
        started = time.monotonic()
        left = end - started
        record: dict[str, Any] = {"status": "skipped", "seconds": 0.0, "error": None, "rows": []}
        result["sections"][section.name] = record
        if left <= 0:
            record["error"] = "the check's time was spent"
        else:
            deadline = started + left * section.share / sum(s.share for s in sections[index:])
            log(f"{section.name}: until {deadline - started:.0f} s from now")
            try:
                record.update(status="ok", rows=section.run(deadline))
            except Exception as error:  # a failed section is its record; the next one runs
                record.update(status="failed", error=f"{type(error).__name__}: {str(error).strip()[:500]}")
                log(f"{section.name} failed:\n{traceback.format_exc()}")
        record["seconds"] = time.monotonic() - started
        save_result()


def make_sections(names: Sequence[str], ctx: Context, *, dry_run: bool) -> list[Section]:
    """The sections by name; each imports its module when it runs, so one that cannot import is its own failure."""

    def operators(deadline: float) -> list[dict[str, Any]]:
        from benchmarks.gpu_check_device import Timer
        from benchmarks.gpu_check_ops import dry_cases, full_cases, operator_rows

        timer = Timer(cuda=ctx.cuda, warmup=1 if dry_run else 3, repeats=3 if dry_run else 20)
        cases = dry_cases() if dry_run else full_cases()
        return operator_rows(cases, cluster=ctx.cluster, device=ctx.device, timer=timer, deadline=deadline, log=ctx.log)

    def cuda_path(deadline: float) -> list[dict[str, Any]]:
        from benchmarks.gpu_check_steps import cuda_path_rows, path_run

        return cuda_path_rows(path_run(dry_run=dry_run), ctx, deadline=deadline)

    def steps(deadline: float) -> list[dict[str, Any]]:
        from benchmarks.gpu_check_steps import dry_step_cases, full_step_cases, step_rows

        return step_rows(dry_step_cases() if dry_run else full_step_cases(), ctx, deadline=deadline)

    runs = {"operators": operators, "cuda_path": cuda_path, "steps": steps}
    return [Section(name=name, share=SHARES[name], run=runs[name]) for name in names]


def check(args: argparse.Namespace) -> int:
    """Run the sections on this machine's GPU (or the CPU, ``--dry-run``); returns 0 when every section ran."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu_check.py: error: no CUDA device here: run on the GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    gpu_name = torch.cuda.get_device_name(0) if cuda else args.price_as
    if not cuda:
        torch.set_num_threads(1)  # the dry run's own loops run as a rank of the program does: one thread
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "version": 1,
        "dry_run": bool(args.dry_run),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python3 -m benchmarks.gpu_check " + " ".join(sys.argv[1:]),
        "budget_s": args.budget_s,
        "machine": {"gpu": gpu_name if cuda else None, "torch": torch.__version__, "python": sys.version.split()[0]},
        "sections": {},
    }

    def save_result() -> None:
        temporary = out / "gpu_check.json.tmp"
        temporary.write_text(json.dumps(result, indent=1))
        temporary.replace(out / "gpu_check.json")

    with open(out / "gpu_check.log", "a") as log_file:
        log = Log(log_file)
        try:
            ctx = _setup(result, gpu_name=gpu_name, cuda=cuda, work=work, log=log)
        except Exception as error:  # autoplan does not import here: say so in the results, run nothing
            result["setup_error"] = f"{type(error).__name__}: {str(error).strip()[:500]}"
            log(f"setup failed:\n{traceback.format_exc()}")
            save_result()
            return 1
        save_result()
        run_sections(
            make_sections(args.sections, ctx, dry_run=args.dry_run),
            budget_s=args.budget_s,
            result=result,
            save_result=save_result,
            log=log,
        )
        log(f"wrote {out / 'gpu_check.json'}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(record["status"] == "ok" for record in result["sections"].values()) else 1


def _setup(result: dict[str, Any], *, gpu_name: str, cuda: bool, work: Path, log: Log) -> Context:
    """The machine's description and the device's cluster (and its file) into ``result``; the sections' context."""
    from benchmarks.gpu_check_device import cluster_for, machine_info, write_cluster

    device = cluster_for(gpu_name)
    cluster = device.cluster
    result["machine"] = machine_info(cuda=cuda)
    result["cluster"] = {
        "name": cluster.name,
        "device": cluster.device.name,
        "note": device.note,
        "json": cluster.to_json(),
    }
    log(f"GPU check on {gpu_name} (priced as {cluster.device.name}: {device.note}); work in {work}")
    missing = [name for name, found in result["machine"]["solvers"].items() if not found]
    if missing:
        log(
            f"planning needs {' and '.join(missing)}, not importable here: the program rows will fail, the eager "
            "rows still run (install the carried wheels: see this file's docstring)"
        )
    return Context(
        cuda=cuda,
        cluster=cluster,
        cluster_file=write_cluster(cluster, work / "cluster.json"),
        work=work,
        log=log,
        programs={},
    )


def report(args: argparse.Namespace) -> int:
    path = Path(args.report)
    path = path / "gpu_check.json" if path.is_dir() else path
    if not path.is_file():
        print(f"gpu_check.py: error: {path} does not exist: give the folder the GPU run wrote", file=sys.stderr)
        return 2
    from benchmarks.gpu_check_report import render, save

    result = json.loads(path.read_text())
    if args.save:
        print(f"wrote {save(result)}", file=sys.stderr)
    else:
        print(render(result), end="")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for gpu_check.json and gpu_check.log")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes and gloo")
    parser.add_argument("--budget-s", type=float, default=400.0, help="seconds for all sections (default 400)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--price-as", default=DRY_RUN_GPU, help="dry run: the GPU name to price the CPU's work as")
    parser.add_argument("--work", help="folder for plans, programs and checkpoints (default: a temporary one)")
    parser.add_argument("--report", metavar="DIR", help="render DIR/gpu_check.json as the results page")
    parser.add_argument("--save", action="store_true", help="with --report: write benchmarks/results/gpu-DATE.md")
    parser.add_argument("--device-call", action="store_true", help="print the `run` tool's arguments for the GPU")
    args = parser.parse_args(argv)
    args.sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}: use {', '.join(SECTIONS)}")
    if args.report is None and args.out is None and not args.device_call:
        parser.error("give --out DIR (run the check) or --report DIR (render its results)")
    return args


def device_call() -> str:
    """The ``run`` tool's arguments for the one GPU call, as JSON."""
    return json.dumps({"command": DEVICE_COMMAND, "timeout_s": DEVICE_TIMEOUT_S, "carry": [WHEELS]}, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device_call:
        print(device_call())
        return 0
    return report(args) if args.report else check(args)


if __name__ == "__main__":
    sys.exit(main())
