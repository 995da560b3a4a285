"""Saving a benchmark table to ``benchmarks/results/<name>-<date>.md`` with machine and command."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save_table(name: str, *, title: str, command: str, description: str, table: str) -> Path:
    today = datetime.date.today().isoformat()
    machine = (
        f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, {platform.system()}"
    )
    text = f"# {title}, {today}\n\nMachine: {machine}.\nCommand: `{command}`\n\n{description}\n\n{table}\n"
    out = RESULTS / f"{name}-{today}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}", file=sys.stderr)
    return out
