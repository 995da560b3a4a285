"""Training steps and the compiled program's CUDA path, for ``benchmarks/gpu_check.py``.

**Steps** (:func:`step_rows`): per model (GPT-350M and GPT-1.3B at batch 8 × 1024 tokens; the dry run: GPT
tiny), two measurements, each beside its own prediction:

* *program* — the model planned for the device's one-device cluster (``auto``, ``adam-mixed``), compiled,
  and its ``train.py`` launched with torchrun (nccl; gloo in the dry run) for ``steps`` steps: the median
  step time after ``warmup`` steps (the program's own timer: barrier and CUDA synchronise around the step)
  against ``estimate.step_time_s``; the peak memory against ``estimate.memory_per_device_bytes``: on CUDA
  ``torch.cuda.max_memory_allocated`` over the run (the program's log line), on the CPU the program's
  ``--measure-memory`` figure (model state + peak saved activations);
* *eager* — the same model, batch and precision in a plain loop in this process (bf16 autocast, fp32
  AdamW, the gradient norm as the program takes it, the whole batch at once, no executor): the median step
  against the closed-form one-device estimate (:func:`planner.baselines.data_parallel.data_parallel` on one
  device, which needs no solver), the CUDA peak and the model state + saved activations against its memory.
  It separates what the cost model misses from what our executor adds, and it still measures when planning
  cannot run (no solver).

**CUDA path** (:func:`cuda_path_rows`), on a small plan: the program started at world 1 over nccl, stopped
after 4 of 6 steps with DCP checkpoints every 2 steps, resumed to step 6; the same 6 steps uninterrupted
under ``--check-parity``; the resumed steps' losses against the uninterrupted run's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.gpu_check_program import ROOT, Context, Done, ModelRun, launch, parse_steps
from executors.precision import Precision, make_optimizer
from executors.training.memory_probe import ActivationMeter, model_state_bytes
from planner.baselines.data_parallel import data_parallel
from planner.costing.setup import CostSetup, make_compute_model
from planner.ir.capture import capture
from planner.ir.model_file import build_kwargs, instantiate, instantiate_inputs, instantiate_targets, load_model_file

OPTIMIZER = "adam-mixed"
RESUME_RTOL = 1e-3  # resumed losses against the uninterrupted run's (the same kernels on the same data)


@dataclass(frozen=True, kw_only=True)
class StepCase:
    run: ModelRun
    steps: int
    warmup: int


def _gpt(name: str, size: str, batch_size: int) -> ModelRun:
    return ModelRun(name=name, model_file="examples/gpt.py", model_args=(("size", size),), batch_size=batch_size)


def full_step_cases() -> list[StepCase]:
    return [StepCase(run=_gpt(f"gpt-{size}", size, 8), steps=15, warmup=3) for size in ("350m", "1.3b")]


def dry_step_cases() -> list[StepCase]:
    return [StepCase(run=_gpt("gpt-tiny", "tiny", 4), steps=4, warmup=1)]


def path_run(*, dry_run: bool) -> ModelRun:
    """The small plan the CUDA path runs (the dry run shares the step case's program)."""
    return _gpt("gpt-tiny", "tiny", 4 if dry_run else 8)


def step_rows(cases: list[StepCase], ctx: Context, *, deadline: float) -> list[dict[str, Any]]:
    """One row per model: its program and its eager loop, each with an error instead when it failed."""
    rows = []
    for index, case in enumerate(cases):
        case_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(cases) - index)
        row: dict[str, Any] = {
            "model": case.run.name,
            "batch_size": case.run.batch_size,
            "steps": case.steps,
            "warmup": case.warmup,
        }
        for part, measure in (("program", program_step), ("eager", eager_step)):
            if time.monotonic() > case_deadline:
                row[part] = {"skipped": "the case's time was spent"}
                continue
            try:
                row[part] = measure(case, ctx, deadline=case_deadline)
            except Exception as error:  # the other part, and the other models, still run
                row[part] = {"error": f"{type(error).__name__}: {str(error).strip()[:500]}"}
            finally:
                if ctx.cuda:
                    torch.cuda.empty_cache()
            ctx.log(f"steps: {case.run.name} {part}: {_summary(row[part])}")
        rows.append(row)
    return rows


def _summary(part: dict[str, Any]) -> str:
    if "measured_step_s" not in part:
        return str(part.get("error") or part.get("skipped"))
    return (
        f"step {part['measured_step_s'] * 1e3:.1f} ms (predicted {part['predicted_step_s'] * 1e3:.1f} ms), "
        f"memory {part['measured_memory_bytes'] / 2**30:.2f} GiB "
        f"(predicted {part['predicted_memory_bytes'] / 2**30:.2f} GiB)"
    )


def program_step(case: StepCase, ctx: Context, *, deadline: float) -> dict[str, Any]:
    """The compiled program's median step and peak memory against its plan's estimate."""
    from planner.plan import load_plan
    from planner.plan.shape import plan_shape

    program, planned = ctx.program(case.run, deadline=deadline)
    plan = load_plan(program.parent / "plan.json")
    args = ["--steps", str(case.steps), "--backend", ctx.backend, *([] if ctx.cuda else ["--measure-memory"])]
    done = launch(program, args, timeout_s=deadline - time.monotonic(), log=ctx.log)
    steps = parse_steps(done.output)
    if not done.ok or len(steps) <= case.warmup:
        raise RuntimeError(f"the program did not run {case.steps} steps ({done.describe()})")
    last = steps[-1]
    measured_memory = last.allocated_bytes if ctx.cuda else last.memory_bytes
    if measured_memory is None:
        raise RuntimeError("the program's log gives no memory figure")
    return {
        "plan": plan_shape(plan),
        "num_microbatches": plan.num_microbatches,
        "predicted_step_s": plan.estimate.step_time_s,
        "measured_step_s": statistics.median(s.step_time_s for s in steps[case.warmup :]),
        "step_times_s": [s.step_time_s for s in steps],
        "predicted_memory_bytes": plan.estimate.memory_per_device_bytes,
        "measured_memory_bytes": measured_memory,
        "memory_source": "torch.cuda.max_memory_allocated" if ctx.cuda else "model state + saved activations",
        "reserved_bytes": last.reserved_bytes,
        "breakdown_s": dict(plan.estimate.breakdown_s),
        "losses": [s.loss for s in steps],
        "planning_s": planned.seconds,
        "run_s": done.seconds,
    }


def eager_step(case: StepCase, ctx: Context, *, deadline: float) -> dict[str, Any]:
    """The plain loop's median step and memory against the closed-form one-device estimate."""
    run = case.run
    model_file = load_model_file(ROOT / run.model_file)
    model_args = dict(run.model_args)
    meta_model, meta_inputs = instantiate(model_file, batch_size=run.batch_size, model_args=model_args)
    graph = capture(meta_model, meta_inputs)
    compute = make_compute_model(graph, ctx.cluster, cost_model="roofline")
    setup = CostSetup(cluster=ctx.cluster, compute=compute, optimizer=OPTIMIZER)
    estimate = data_parallel(graph, setup, batch_size=run.batch_size)[1]  # one device: no solver is imported
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = model_file.build_model(**build_kwargs(model_file, model_args))
    inputs = _on(
        ctx.device, instantiate_inputs(model_file, batch_size=run.batch_size, model_args=model_args, on_meta=False)
    )
    targets = _on(
        ctx.device, instantiate_targets(model_file, batch_size=run.batch_size, model_args=model_args, on_meta=False)
    )
    loss_data = targets if model_file.has_targets else inputs
    loss_fn = model_file.loss_fn or (lambda output, _: output.float().mean())
    params = list(model.parameters())
    optimizer = make_optimizer(OPTIMIZER, params, lr=1e-4)
    precision = Precision.for_optimizer(OPTIMIZER)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast(ctx.device):
            loss = loss_fn(model(*inputs), loss_data)
        loss.backward()
        # the gradient norm, as the program takes it every step (and the estimate prices it)
        squares = [p.grad.detach().square().sum(dtype=torch.float64) for p in params if p.grad is not None]
        float(torch.stack(squares).sum().sqrt())
        optimizer.step()

    times = [_timed(step, cuda=ctx.cuda) for _ in range(case.steps)]
    peak = torch.cuda.max_memory_allocated() if ctx.cuda else None
    with ActivationMeter() as meter:  # after the timed steps: the meter's hooks cost host time
        step()
    metered = model_state_bytes(params, optimizer) + meter.peak_bytes
    return {
        "plan": "one device, whole batch, no executor",
        "predicted_step_s": estimate.step_time_s,
        "measured_step_s": statistics.median(times[case.warmup :]),
        "step_times_s": times,
        "predicted_memory_bytes": estimate.memory_per_device_bytes,
        "measured_memory_bytes": peak if peak is not None else metered,
        "memory_source": "torch.cuda.max_memory_allocated" if peak is not None else "model state + saved activations",
        "state_and_activation_bytes": metered,
        "breakdown_s": dict(estimate.breakdown_s),
    }


def _on(device: str, values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in values)


def _timed(step: Callable[[], None], *, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def cuda_path_rows(run: ModelRun, ctx: Context, *, deadline: float) -> list[dict[str, Any]]:
    """The program's CUDA path at world 1 (module docstring): one row per check, ``ok`` and what was seen."""
    program, _ = ctx.program(run, deadline=deadline)
    checkpoints = ctx.work / f"checkpoints-{run.name}"
    common = ["--steps", "6", "--backend", ctx.backend]

    def start(*extra: str) -> tuple[Done, list]:
        done = launch(program, [*common, *extra], timeout_s=deadline - time.monotonic(), log=ctx.log)
        return done, parse_steps(done.output)

    first, first_steps = start("--stop-after", "4", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2")
    latest = (checkpoints / "latest").read_text().strip() if (checkpoints / "latest").is_file() else None
    saved = sorted(path.name for path in checkpoints.glob("step-*")) if checkpoints.is_dir() else []
    resumed, resumed_steps = start("--resume", "--checkpoint-dir", str(checkpoints))
    parity, parity_steps = start("--check-parity")
    uninterrupted = {s.step: s.loss for s in parity_steps}
    compared = [s for s in resumed_steps if s.step in uninterrupted]
    largest = max((_relative(s.loss, uninterrupted[s.step]) for s in compared), default=None)
    resumed_at = [s.step for s in resumed_steps]
    matched = sum(bool(s.parity_ok) for s in parity_steps)
    difference = "no step to compare" if largest is None else f"largest relative difference {largest:.2e}"
    return [
        _check(
            f"{ctx.backend} init and 4 steps at world 1",
            first.ok and len(first_steps) == 4,
            first,
            detail=f"{len(first_steps)} steps, on {ctx.device}",
        ),
        _check(
            "DCP checkpoints every 2 steps",
            latest == "step-4" and saved == ["step-2", "step-4"],
            first,
            detail=f"latest {latest}, saved {', '.join(saved) or 'none'}",
        ),
        _check("resume at step 5", resumed.ok and resumed_at == [5, 6], resumed, detail=f"steps run {resumed_at}"),
        _check(
            "--check-parity at world 1, 6 steps",
            parity.ok and len(parity_steps) == 6 and matched == 6,
            parity,
            detail=f"{matched} of {len(parity_steps)} steps match",
        ),
        _check(
            "resumed losses equal the uninterrupted run's",
            largest is not None and largest <= RESUME_RTOL,
            resumed,
            detail=f"{difference} (tolerance {RESUME_RTOL:g})",
            measured=largest,
        ),
    ]


def _relative(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-12)


def _check(
    name: str, ok: bool, done: Done, *, detail: str | None = None, measured: float | None = None
) -> dict[str, Any]:
    """A check's row; the run's failure is part of its detail."""
    seen = done.describe() if detail is None else detail + ("" if done.ok else f"; the run: {done.describe()}")
    row = {"check": name, "ok": bool(ok), "detail": seen, "seconds": done.seconds}
    return row if measured is None else {**row, "measured": measured}
