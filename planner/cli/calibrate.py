"""``plan calibrate [--out FILE]``: parse the options, calibrate this machine, write a cluster file.

The work is :mod:`calibration`'s (:func:`calibration.machine.calibrate_machine`: the raw measurements, their
fits and the executor probes); the written file is accepted by ``--cluster FILE``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from calibration.machine import calibrate_machine


def _parser() -> argparse.ArgumentParser:
    from planner.cli.options import UsageParser

    parser = UsageParser(
        prog="plan calibrate",
        description=(
            "Measure this machine as N local devices (one process each, all running at once): fp32 matmul "
            "throughput and memory bandwidth of a process, gloo all-reduce, all-gather and point-to-point latency "
            "and bandwidth between the processes at several sizes, and then the host overheads of our executors "
            "(per operator, per sharded operator, per pipeline microbatch, per step, per message), fitted on small "
            "probe plans run for real. Writes a cluster file for --cluster FILE. Calibrate with as many processes "
            "as the plans will run on (--processes 4 for 4 local ranks). Run it on an idle machine."
        ),
    )
    parser.add_argument("--out", default="cluster.json", metavar="FILE", help="cluster file to write (.json or .toml)")
    parser.add_argument("--processes", type=int, default=2, metavar="N", help="local processes to measure between")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, repeats and probe steps")
    parser.add_argument("--no-probes", action="store_true", help="skip the executor probes (keeps raw figures only)")
    return parser


def run_calibrate(argv: Sequence[str]) -> int:
    from calibration.measure import check_output_path, write_cluster_file

    options = _parser().parse_args(list(argv))
    check_output_path(options.out)

    def progress(message: str) -> None:
        sys.stderr.write(f"{message}\n")

    probe_steps = 0 if options.no_probes else (3 if options.quick else 10)
    result = calibrate_machine(
        num_processes=options.processes, quick=options.quick, progress=progress, probe_steps=probe_steps
    )
    path = write_cluster_file(result, options.out)
    cluster = result.to_cluster()
    print(
        f"wrote {path}: {cluster.device.peak('float32') / 1e9:.1f} GFLOP/s fp32, "
        f"{cluster.device.memory_bandwidth / 1e9:.2f} GB/s memory, "
        f"link latency {cluster.intra_node.latency_s * 1e6:.0f} µs, "
        f"bandwidth {cluster.intra_node.bandwidth / 1e9:.2f} GB/s"
    )
    print(f"use it with: plan MODEL_FILE --cluster {path} --batch-size B")
    return 0
