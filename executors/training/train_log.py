"""The line a training program prints per step: loss, step time, throughput and MFU beside the plan's estimate.

Throughput counts *tokens* when the model's first input is a 2-D integer tensor (``batch × sequence``
token ids: tokens per step = its number of elements at the global batch) and *samples* (the global
batch) otherwise. MFU is the model's FLOPs per step over the step time and the peak of all devices:
the plan's estimate carries both its own MFU and its step time, so the measured MFU is
``estimate.mfu × estimate.step_time_s / measured step`` (the same FLOPs, the measured time). On a
machine unlike the plan's cluster (a CPU run of a GPU plan) the MFU is against the plan's devices,
so it reads as "how far this machine is from the plan", not as this machine's utilisation.

On CUDA the line also gives the caching allocator's peak allocated and reserved bytes since the start
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``, the largest rank's) beside the plan's
memory per device; ``--measure-memory`` adds the model state + saved activations figure on any device.

The same logged steps go, when asked, to a CSV file (:class:`CsvLog`, ``--log-csv PATH``: the header once, one row
per logged step; a resumed run appends) and to TensorBoard (:class:`TensorBoardLog`, ``--tensorboard DIR``:
``torch.utils.tensorboard.SummaryWriter`` scalars under ``train/``, needing the ``tensorboard`` package,
:func:`check_tensorboard`). :class:`StepLogger` writes them on rank 0, where it runs. Neither changes the step
time the plan estimates (rank 0 writes after the step is timed).
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from cost_models.units import MIB
from executors.training.memory_probe import AllocatorPeak
from planner.errors import AutoplanError
from planner.ir.graph import TensorMeta
from planner.plan import Plan


@dataclass(frozen=True, kw_only=True)
class Throughput:
    unit: str  # "tokens" or "samples"
    per_step: int


def throughput_unit(plan: Plan, first_input: TensorMeta | None) -> Throughput:
    if first_input is not None and len(first_input.shape) == 2 and first_input.dtype.startswith("int"):
        return Throughput(unit="tokens", per_step=int(first_input.shape[0] * first_input.shape[1]))
    return Throughput(unit="samples", per_step=plan.batch_size)


def step_record(throughput: Throughput, fields: dict[str, Any]) -> dict[str, float | int | str]:
    """One logged step as the CSV row and TensorBoard scalars hold it (empty where not measured)."""
    step_time_s = fields["step_time_s"]
    peak: AllocatorPeak | None = fields.get("allocator_peak")
    memory = fields.get("memory_bytes")
    grad_norm = fields.get("grad_norm")
    return {
        "step": fields["step"] + 1,
        "loss": fields["loss"],
        "step_time_s": step_time_s,
        f"{throughput.unit}_per_s": throughput.per_step / step_time_s if step_time_s > 0 else 0.0,
        "lr": fields["lr"],
        "grad_norm": grad_norm if grad_norm is not None else "",
        "memory_bytes": memory if memory is not None else "",
        "cuda_peak_allocated_bytes": peak.allocated_bytes if peak is not None else "",
    }


class CsvLog:
    """``--log-csv PATH``: one row per logged step (:func:`step_record`), the header once (kept when appending)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header_written = self.path.is_file() and self.path.stat().st_size > 0

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(record))
            if not self.header_written:
                writer.writeheader()
                self.header_written = True
            writer.writerow(record)


def check_tensorboard() -> None:
    """``--tensorboard`` needs the ``tensorboard`` package; one line naming it when it is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise AutoplanError("--tensorboard needs the tensorboard package, not installed here: pip install tensorboard")


class TensorBoardLog:
    """``--tensorboard DIR``: each logged step's numbers as ``train/<name>`` scalars at its step."""

    def __init__(self, directory: str | Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, Any]) -> None:
        for name, value in record.items():
            if name != "step" and value != "":
                self.writer.add_scalar(f"train/{name}", float(value), global_step=int(record["step"]))
        self.writer.flush()


class StepLogger:
    """Prints one line per logged step on rank 0 (``every`` steps and the last one), and writes the step to the
    CSV file and TensorBoard when given (``csv_path``, ``tensorboard_dir``)."""

    def __init__(
        self,
        plan: Plan,
        *,
        throughput: Throughput,
        every: int = 1,
        out: TextIO | None = None,
        csv_path: str | Path | None = None,
        tensorboard_dir: str | Path | None = None,
    ) -> None:
        self.plan, self.throughput, self.every = plan, throughput, max(1, every)
        self.out = out or sys.stdout
        self.csv_path, self.tensorboard_dir = csv_path, tensorboard_dir
        self.sinks: list[CsvLog | TensorBoardLog] | None = None  # opened at the first step, on rank 0 only

    def header(self) -> str:
        estimate = self.plan.estimate
        return (
            f"plan estimate: step {_ms(estimate.step_time_s)}, "
            f"{self.throughput.per_step / estimate.step_time_s:,.0f} {self.throughput.unit}/s, "
            f"MFU {estimate.mfu:.1%} on {self.plan.cluster.num_devices} × {self.plan.cluster.device.name}"
        )

    def line(
        self,
        *,
        step: int,
        loss: float,
        step_time_s: float,
        lr: float,
        grad_norm: float | None = None,
        memory_bytes: int | None = None,
        parity: str | None = None,
        allocator_peak: AllocatorPeak | None = None,
    ) -> str:
        estimate = self.plan.estimate
        mfu = estimate.mfu * estimate.step_time_s / step_time_s if step_time_s > 0 else 0.0
        rate = self.throughput.per_step / step_time_s if step_time_s > 0 else 0.0
        norm = f"  grad norm {grad_norm:.3g}" if grad_norm is not None else ""
        if memory_bytes is not None:
            planned = estimate.memory_per_device_bytes
            norm += f"  memory {memory_bytes / MIB:.1f} MiB (plan {planned / MIB:.1f} MiB)"
        if allocator_peak is not None:
            norm += (
                f"  CUDA peak {allocator_peak.allocated_bytes / MIB:.1f} MiB allocated, "
                f"{allocator_peak.reserved_bytes / MIB:.1f} MiB reserved "
                f"(plan {estimate.memory_per_device_bytes / MIB:.1f} MiB)"
            )
        return (
            f"step {step + 1}  loss {loss:.6f}  {_ms(step_time_s)} (plan {_ms(estimate.step_time_s)})  "
            f"{rate:,.0f} {self.throughput.unit}/s  MFU {mfu:.1%}  lr {lr:.3g}{norm}"
            f"{f'  {parity}' if parity else ''}"
        )

    def log(self, *, step: int, last: bool, **fields: Any) -> None:
        """Print the step's line every ``every`` steps, on the last step, and whenever parity is checked."""
        if (step + 1) % self.every == 0 or last or fields.get("parity"):
            print(self.line(step=step, **fields), file=self.out, flush=True)
            if self.sinks is None:
                self.sinks = [CsvLog(self.csv_path)] if self.csv_path else []
                self.sinks += [TensorBoardLog(self.tensorboard_dir)] if self.tensorboard_dir else []
            record = step_record(self.throughput, {"step": step, **fields})
            for sink in self.sinks:
                sink.write(record)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"
