"""Writing a file so that a crash or an error leaves the old file or the new one, never half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from planner.errors import AutoplanError


def write_text_atomic(path: Path, text: str, *, what: str = "file") -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as temp:
            temp.write(text)
            temp.flush()
            os.fsync(temp.fileno())
        os.replace(temp_name, path)
    except OSError as error:
        raise AutoplanError(f"cannot write {what} {path}: {error.strerror or error}") from None
    finally:
        Path(temp_name).unlink(missing_ok=True)


def save_figure_atomic(figure: Any, path: Path, *, dpi: int = 120, tight: bool = False) -> None:
    """Save a matplotlib figure as PNG beside ``path``, then rename it over ``path``; closes nothing. ``tight``:
    crop or grow the page to every artist drawn (``bbox_inches="tight"``), so a legend outside the axes is kept."""
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(handle)
    try:
        figure.savefig(temp_name, dpi=dpi, bbox_inches="tight" if tight else None)
        os.replace(temp_name, path)
    except OSError as error:
        raise AutoplanError(f"cannot write figure {path}: {error.strerror or error}") from None
    finally:
        Path(temp_name).unlink(missing_ok=True)
