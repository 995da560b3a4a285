"""What ``plan compile`` records about the program directory it writes, and what the program checks on load.

A compiled directory holds its model: :func:`copy_model_files` copies the plan's model file into
``DIR/model/`` with the files beside it that it imports (:func:`local_imports`: ``import x`` / ``from x import
...`` naming ``x.py`` or a package ``x/`` in the model file's folder, followed through those files too; a
package is copied whole, its ``.py`` files). The plan in ``DIR/plan.json`` names ``model/<file>`` relative to
itself. Imports made at run time by name (``importlib.import_module(f"...")``) and data files the model reads
are not found: copy those by hand.

``DIR/compiled.json`` (:func:`write_record`) records the autoplan and torch versions that compiled the program,
torch's supported range, the sha256 of every copied model file and of the ``train.py`` as written.
:func:`check_program_dir` is what the program runs before it reads its plan (``runtime.load_plan``), and what
``plan run DIR`` runs before it starts anything:

* the model: a copied file whose sha256 is not the recorded one stops the program in one line — the model
  changed since ``plan compile``, so re-plan and re-compile (the runtime's check of the rebuilt model against the
  plan's graph fingerprint still follows; this one answers first and names the file);
* the version rule (:func:`version_verdict`): the installed autoplan must have the compiling one's major and minor
  version (``0.1.x`` for ``0.1.0``) — another minor version may read the plan or run its parts differently, so the
  program refuses to start and names the version to install; another patch version only warns (a patch keeps the
  plan format and what the executors run). An autoplan with no installed metadata (a checkout on ``PYTHONPATH``)
  warns that it cannot be checked.

:func:`program_edited` tells ``plan run`` whether ``train.py`` is the text ``plan compile`` wrote (its recorded
sha256), so a template change in a newer autoplan does not make a program look edited.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError

RECORD = "compiled.json"
MODEL_FOLDER = "model"
DISTRIBUTION = "autoplan"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file's text (what ``compiled.json`` records of each model file and of ``train.py``)."""
    return sha256_text(path.read_text())


def local_imports(model_path: Path) -> list[Path]:
    """The files beside ``model_path`` that it imports, directly or through each other (modules ``x.py`` and
    packages ``x/``), in the order found; the model file itself is not among them."""
    folder = model_path.resolve().parent
    found: list[Path] = []
    pending = [model_path.resolve()]
    while pending:
        source = pending.pop()
        for name in _imported_names(source):
            for candidate in (folder / f"{name}.py", folder / name):
                if candidate.exists() and candidate != model_path.resolve() and candidate not in found:
                    found.append(candidate)
                    pending.extend(sorted(candidate.rglob("*.py")) if candidate.is_dir() else [candidate])
    return found


def _imported_names(source: Path) -> set[str]:
    """The top-level names of the absolute imports in ``source`` (``a`` of ``import a.b`` and ``from a import
    c``); a file that does not parse imports nothing here (loading the model file reports it)."""
    try:
        tree = ast.parse(source.read_text(), filename=str(source))
    except (SyntaxError, UnicodeDecodeError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def copy_model_files(model_path: Path, out_dir: Path) -> dict[str, str]:
    """Copy the model file and its local imports into ``out_dir/model/``; returns ``{path relative to out_dir:
    sha256}`` of every copied ``.py`` file, the model file first."""
    model_path = model_path.resolve()
    target = out_dir / MODEL_FOLDER
    target.mkdir(parents=True, exist_ok=True)
    copied: dict[str, str] = {}
    for source in [model_path, *local_imports(model_path)]:
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for file in files:
            relative = file.relative_to(model_path.parent)
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            if file.resolve() != (target / relative).resolve():  # re-compiling a directory in place keeps it
                shutil.copyfile(file, target / relative)
            copied[f"{MODEL_FOLDER}/{relative.as_posix()}"] = file_sha256(file)
    return copied


def installed_version() -> str | None:
    """The installed autoplan's version (None: no package metadata, e.g. a checkout on ``PYTHONPATH``)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_requirement() -> str:
    """The torch versions this autoplan supports, from its package metadata (``>=2.4,<2.14``)."""
    try:
        requirements = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
    for requirement in requirements:
        name = requirement.split(";")[0].strip()
        if name.startswith("torch") and name[len("torch") :][:1] in "<>=!~ ":
            bounds = name[len("torch") :].strip().split(",")
            return ",".join(sorted(bounds, key=lambda bound: not bound.startswith(">"))) or "any"
    return "any"


@dataclass(frozen=True, kw_only=True)
class CompileRecord:
    """``DIR/compiled.json``: see the module docstring."""

    autoplan: str | None
    torch: str
    torch_requirement: str
    train_py_sha256: str
    model_files: dict[str, str]

    def to_json(self) -> dict[str, object]:
        return {
            "autoplan": self.autoplan,
            "torch": self.torch,
            "torch_requirement": self.torch_requirement,
            "train_py_sha256": self.train_py_sha256,
            "model_files": self.model_files,
        }


def write_record(out_dir: Path, record: CompileRecord) -> None:
    write_text_atomic(out_dir / RECORD, json.dumps(record.to_json(), indent=2) + "\n", what="compile record")


def read_record(program_dir: Path) -> CompileRecord | None:
    """The directory's record; None when it has none (compiled by an autoplan before records)."""
    path = program_dir / RECORD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return CompileRecord(**data)
    except (json.JSONDecodeError, TypeError) as error:
        raise AutoplanError(f"{path} is not a compile record ({error}): re-compile with `plan compile`") from None


def version_verdict(compiled: str | None, installed: str | None) -> tuple[bool, str | None]:
    """``(may run, message)`` for the version rule of the module docstring; message None when they agree."""
    if compiled is None or compiled == installed:
        return True, None
    install = f"install autoplan {compiled} on every node (pip install autoplan=={compiled})"
    if installed is None:
        return True, f"cannot tell which autoplan is installed (no package metadata); this program needs {compiled}"
    if installed.split(".")[:2] != compiled.split(".")[:2]:
        return False, f"this program was compiled by autoplan {compiled}, this is autoplan {installed}: {install}"
    return True, f"this program was compiled by autoplan {compiled}, this is autoplan {installed} (a patch apart)"


def check_program_dir(program_dir: Path) -> str | None:
    """Check the directory against its record (model files, then autoplan's version): AutoplanError naming what
    to do, or the warning to print (None: nothing to say). A directory without a record is not checked."""
    record = read_record(program_dir)
    if record is None:
        return None
    for name, digest in record.model_files.items():
        path = program_dir / name
        if not path.is_file():
            raise AutoplanError(f"{path} is missing (plan compile copied it there): re-compile with `plan compile`")
        if file_sha256(path) != digest:
            raise AutoplanError(
                f"{path} changed since `plan compile` (its sha256 is not the one in {RECORD}): re-plan the model "
                "(`plan MODEL_FILE ... --out PLAN.json`) and re-compile (`plan compile PLAN.json --out DIR`)"
            )
    runs, message = version_verdict(record.autoplan, installed_version())
    if not runs:
        raise AutoplanError(message)
    return message


def program_edited(program_dir: Path, program: Path) -> bool | None:
    """Whether ``program`` differs from the ``train.py`` ``plan compile`` wrote (None: no record to tell)."""
    record = read_record(program_dir)
    if record is None:
        return None
    return file_sha256(program) != record.train_py_sha256
