"""Our executors against hand-written torch.distributed code: same ranks, model, batch and optimizer.

Each case plans a model file for two local CPU ranks (gloo, one thread per rank), starts the two
ranks with torchrun, and times two training loops in the same job, one step of each in turn:

* **ours**: the plan run the way ``plan run`` runs it (:func:`executors.session.load_workload`,
  :func:`executors.runner.make_runner`):
  ``load_workload`` -> ``make_runner`` -> per step ``zero_grad``, ``runner.step(inputs)`` (forward,
  backward, gradient sync, loss all-reduce or broadcast), ``SGD.step``. A data-parallel plan runs
  on ``DataParallelRunner`` (the captured graph interpreted node by node, wrapped in DDP); a
  two-stage pipeline plan (``megatron``, degrees ``(1, 2, 1)``) on ``PipelineRunner`` (graph
  segments on DTensor over one-device meshes, under ``torch.distributed.pipelining``).
* **hand-written**: what a user writes with the same model file's ``nn.Module`` and loss. Data
  parallel: ``DistributedDataParallel(model)``, each rank its half of the batch, forward, loss,
  backward, ``SGD.step``. Pipeline: the model cut by hand into two modules at the plan's boundary
  (the first stage's last ``blocks`` index, read from the plan's parameter names), each rank its
  ``PipelineStage``, ``ScheduleGPipe``/``Schedule1F1B`` with the plan's microbatches and the
  model's loss as the schedule's ``loss_fn`` (``return_outputs=False``: the loop needs no logits).

Every timed step starts after a barrier; a step's time is the slowest rank's (all-reduce MAX),
the table gives the median over the timed steps after warm-up and the ratio ours / hand-written
(target ≤ 1.10). It also gives the step's CPU time (``time.thread_time`` of both ranks' main
threads, summed): Python and kernel work without the waiting, a cross-check that other processes
on a shared machine disturb less than wall time. Planning and the fingerprint capture happen
before the loop, outside the timing. The first step's loss of both loops is reported: the same
number says they compute the same thing.

    python -m benchmarks.executor_overhead [--cases mlp-dp,...] [--warmup 3] [--steps 20] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_page import save_table
from executors.training.launch import torchrun_argv

ROOT = Path(__file__).resolve().parent.parent

TARGET = 1.10
MLP_ARGS = {"hidden": 1024, "layers": 8}
GPT_ARGS = {"size": "125m", "layers": 4, "hidden": 256, "heads": 4, "seq": 128, "vocab": 4096}
# name -> (example, model args, batch size, method, schedule)
CASES = {
    "mlp-dp": ("mlp", MLP_ARGS, 128, "data-parallel", None),
    "mlp-pp-gpipe": ("mlp", MLP_ARGS, 128, "megatron", "gpipe"),
    "mlp-pp-1f1b": ("mlp", MLP_ARGS, 128, "megatron", "1f1b"),
    "gpt-dp": ("gpt", GPT_ARGS, 8, "data-parallel", None),
    "gpt-pp-1f1b": ("gpt", GPT_ARGS, 8, "megatron", "1f1b"),
}
MICROBATCHES = 4


# ---------------------------------------------------------------------------------------------
# the parent: plan, launch, tabulate


def make_plan(case: str, out: Path) -> Path:
    from cost_models.cluster import load_cluster
    from planner.api import plan_prepared, prepare_model_file
    from planner.plan import save_plan

    example, args, batch, method, schedule = CASES[case]
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    options = {} if schedule is None else {"degrees": (1, 2, 1), "schedule": schedule, "microbatches": MICROBATCHES}
    prepared = prepare_model_file(
        ROOT / "examples" / f"{example}.py", cluster, batch_size=batch, model_args=args, **options
    )
    plan = plan_prepared(prepared, method)
    save_plan(plan, out)
    return out


def run_case(case: str, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = make_plan(case, Path(tmp) / "plan.json")
        out = Path(tmp) / "result.json"
        worker_args = ["--rank-worker", case, "--plan", plan_path, "--out", out, "--warmup", warmup, "--steps", steps]
        command = torchrun_argv(world=2, module="benchmarks.executor_overhead", args=worker_args)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise SystemExit(f"case {case} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def table(results: list[dict]) -> str:
    header = [
        "case",
        "executor",
        "batch",
        "ours ms",
        "hand-written ms",
        "ratio",
        f"≤ {TARGET:.2f}",
        "CPU ms ours / hand",
        "CPU ratio",
        "loss ours / hand (step 1)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        ours, hand = statistics.median(r["ours_s"]), statistics.median(r["hand_s"])
        ours_cpu, hand_cpu = statistics.median(r["ours_cpu_s"]), statistics.median(r["hand_cpu_s"])
        ratio = ours / hand
        lines.append(
            f"| {r['case']} | {r['executor']} | {r['batch']} | {ours * 1e3:.1f} | {hand * 1e3:.1f} | {ratio:.3f} | "
            f"{'yes' if ratio <= TARGET else '**no**'} | {ours_cpu * 1e3:.1f} / {hand_cpu * 1e3:.1f} | "
            f"{ours_cpu / hand_cpu:.3f} | {r['loss_ours']:.6g} / {r['loss_hand']:.6g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.executor_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    parser.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each loop (default %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each loop (default %(default)s)")
    parser.add_argument("--save", action="store_true", help="write the table to benchmarks/results/")
    options = parser.parse_args()
    if options.rank_worker:
        rank_worker(options.rank_worker, options.plan, options.out, options.warmup, options.steps)
        return
    results, load_before = [], os.getloadavg()[0]
    for case in options.cases.split(","):
        started = time.perf_counter()
        results.append(run_case(case, options.warmup, options.steps))
        print(
            table(results[-1:]).splitlines()[-1] + f"  ({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    text = table(results)
    print(text)
    if options.save:
        models = "; ".join(f"{name}: {CASES[name][0]}.py {CASES[name][1]}" for name in options.cases.split(","))
        description = (
            "Median step time (zero_grad, forward, backward, gradient sync, SGD step; slowest rank after a "
            f"barrier) over {options.steps} timed steps after {options.warmup} warm-up steps, two CPU ranks "
            "(torchrun, gloo, one thread each), the two loops alternating step by step in one job. *ours*: the "
            "plan run by `executors.runner.make_runner` (as `plan run` does); *hand-written*: DDP over the user's "
            "nn.Module, or the module cut by hand at the plan's stage boundary under torch.distributed.pipelining "
            f"with the same schedule and {MICROBATCHES} microbatches. *-dp* cases: method data-parallel; *-pp-* "
            "cases: method megatron with degrees (1, 2, 1). Ratio = ours / hand-written, target ≤ "
            f"{TARGET:.2f}. *CPU ms*: median of the step's CPU time on both ranks' main threads together "
            "(`time.thread_time`; no waiting), less disturbed by other processes than wall time. Load average "
            f"(1 min) before / after the run: {load_before:.1f} / {os.getloadavg()[0]:.1f}.\n\nModels: {models}."
        )
        command = "python -m benchmarks.executor_overhead " + " ".join(sys.argv[1:])
        save_table(
            "executor_overhead",
            title="Executor overhead against hand-written torch.distributed",
            command=command,
            description=description,
            table=text,
        )


# ---------------------------------------------------------------------------------------------
# one rank (started by torchrun)


def rank_worker(case: str, plan_path: Path, out: Path, warmup: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from executors.runner import load_cpu_runner
    from executors.session import init_distributed

    rank, world = init_distributed(backend="gloo", timeout_s=120)
    torch.set_num_threads(1)
    workload, runner, inputs = load_cpu_runner(plan_path)
    plan = workload.plan
    ours_opt = torch.optim.SGD(list(dict.fromkeys(runner.parameters())), lr=0.01)

    def ours_step() -> float:
        ours_opt.zero_grad(set_to_none=True)
        loss = runner.step(inputs)
        ours_opt.step()
        return loss

    hand_model, hand_inputs = workload.build()  # the user's own nn.Module, same seed: same weights and batch
    if len(plan.stages) == 1:
        hand_step = handwritten_ddp(hand_model, hand_inputs, workload.loss_fn, rank, world)
    else:
        hand_step = handwritten_pipeline(plan, CASES[case][0], hand_model, hand_inputs, workload.loss_fn, rank)

    times = {"ours": [], "hand": []}
    cpu = {"ours": [], "hand": []}
    first_loss = {}
    for step in range(warmup + steps):
        for name, fn in (("ours", ours_step), ("hand", hand_step)):
            dist.barrier()
            started, started_cpu = time.perf_counter(), time.thread_time()
            loss = fn()
            elapsed, elapsed_cpu = time.perf_counter() - started, time.thread_time() - started_cpu
            if step == 0:
                first_loss[name] = loss
            if step >= warmup:
                times[name].append(elapsed)
                cpu[name].append(elapsed_cpu)
    result = {}
    for name in times:
        wall, busy = torch.tensor(times[name], dtype=torch.float64), torch.tensor(cpu[name], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
        dist.all_reduce(busy)  # CPU seconds of both ranks' main threads
        result[f"{name}_s"], result[f"{name}_cpu_s"] = wall.tolist(), busy.tolist()
    hand_loss = torch.tensor(first_loss["hand"], dtype=torch.float64)
    if len(plan.stages) == 1:  # each rank's half-batch loss: their mean is the batch's
        dist.all_reduce(hand_loss)
        hand_loss /= world
    else:  # only the last stage has it; the others report -inf
        dist.all_reduce(hand_loss, op=dist.ReduceOp.MAX)
    if rank == 0:
        executor = type(runner).__name__
        record = {"case": case, "executor": executor, "batch": plan.batch_size, **result}
        out.write_text(json.dumps(record | {"loss_ours": first_loss["ours"], "loss_hand": hand_loss.item()}))
    dist.destroy_process_group()


def handwritten_ddp(model, inputs, loss_fn, rank: int, world: int):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    mine = tuple(x.chunk(world)[rank] for x in inputs)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(*mine), mine)
        loss.backward()
        optimizer.step()
        return loss.item()  # this rank's half-batch loss

    return step


def block_split(plan) -> int:
    """How many ``blocks`` the plan's first stage holds (its parameters are ``blocks.{i}.*``)."""
    first = {int(name.split(".")[1]) for name in plan.stages[0].param_placements if name.startswith("blocks.")}
    later = {int(n.split(".")[1]) for s in plan.stages[1:] for n in s.param_placements if n.startswith("blocks.")}
    if not first or not later or max(first) + 1 != min(later):
        raise SystemExit(f"the plan's stage boundary is not between two blocks: {sorted(first)} | {sorted(later)}")
    return max(first) + 1


def split_model(example: str, model, k: int):
    """The model cut by hand after ``blocks[k - 1]``: (first half, second half)."""
    import torch
    from torch import nn

    if example == "mlp":

        class Last(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.blocks, self.head = model.blocks[k:], model.head

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.blocks(x))

        return model.blocks[:k], Last()

    class GPTFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe, self.blocks = model.wte, model.wpe, model.blocks[:k]

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return x

    class GPTLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks, self.ln_f, self.lm_head = model.blocks[k:], model.ln_f, model.lm_head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPTFirst(), GPTLast()


def handwritten_pipeline(plan, example: str, model, inputs, loss_fn, rank: int):
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    first, last = split_model(example, model, block_split(plan))
    m = plan.num_microbatches
    micro = inputs[0].chunk(m)[0]
    with torch.no_grad():
        boundary = first(micro)
    module = first if rank == 0 else last
    stage = pipelining.PipelineStage(
        module, rank, 2, torch.device("cpu"), input_args=(micro if rank == 0 else boundary,), group=dist.group.WORLD
    )
    schedule_class = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[plan.schedule]
    schedule = schedule_class(stage, n_microbatches=m, loss_fn=lambda output, target: loss_fn(output, (target,)))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs[0], return_outputs=False)
        else:
            schedule.step(target=inputs[0], losses=losses, return_outputs=False)
        optimizer.step()
        return torch.stack(losses).mean().item() if losses else float("-inf")

    return step


if __name__ == "__main__":
    main()
