"""Model files: ``build_model(**kwargs)``, ``example_inputs(batch_size)``, optional
``example_targets(batch_size)`` and ``loss_fn``.

The convention:

* ``build_model(**kwargs) -> nn.Module``;
* ``example_inputs(batch_size, **kwargs)`` -> one step's forward inputs, a tensor or a tuple of
  tensors (``model(*inputs)``);
* ``example_targets(batch_size, **kwargs)`` (optional) -> one step's targets (labels), a tensor or
  a tuple of tensors, cut along the batch like the inputs;
* ``loss_fn(output, data)`` (optional): ``data`` is the targets tuple when the file defines
  ``example_targets``, else the inputs tuple (files written before targets existed keep working);
  without ``loss_fn`` the loss is the mean of the output.

A model file is imported like a script: its own folder is on ``sys.path``, so it may import the
files beside it. :func:`load_model_file` imports a model file by path; :func:`parse_model_args`
turns ``--model-arg key=value`` strings into keyword arguments; :func:`instantiate` builds the
model and its inputs, on the meta device by default so that planning a 39B-parameter model
allocates none of its weights; :func:`instantiate_targets` builds the targets. Every failure is an
:class:`AutoplanError` that names the file and what to fix.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.errors import AutoplanError


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    path: Path
    build_model: Callable[..., torch.nn.Module]
    example_inputs: Callable[..., Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    example_targets: Callable[..., Any] | None = None

    @property
    def has_targets(self) -> bool:
        return self.example_targets is not None


def load_model_file(path: str | Path) -> ModelFile:
    """Import the model file at ``path`` and check it has the two required functions."""
    path = Path(path)
    if not path.is_file():
        raise AutoplanError(f"model file {path} does not exist")
    if path.suffix != ".py":
        raise AutoplanError(f"model file {path} is not a Python file (.py)")
    module_name = f"autoplan_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # like a script: the file may import its neighbours
        sys.path.append(folder)
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        sys.modules.pop(module_name, None)
        raise AutoplanError(f"model file {path} failed to import: {_describe(error, path)}") from None
    missing = [name for name in ("build_model", "example_inputs") if not callable(getattr(module, name, None))]
    if missing:
        raise AutoplanError(
            f"model file {path} has no {' or '.join(missing)} function: define "
            "build_model(**kwargs) -> nn.Module and example_inputs(batch_size) -> tuple of tensors"
        )
    loss_fn = getattr(module, "loss_fn", None)
    targets = getattr(module, "example_targets", None)
    return ModelFile(
        path=path,
        build_model=module.build_model,
        example_inputs=module.example_inputs,
        loss_fn=loss_fn if callable(loss_fn) else None,
        example_targets=targets if callable(targets) else None,
    )


def _describe(error: BaseException, path: Path) -> str:
    """``NameError: name 'x' is not defined (line 12)`` — the line in the user's file."""
    text = str(error).strip().splitlines()
    message = f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
    if isinstance(error, SyntaxError) and error.lineno:
        return f"{message} (line {error.lineno})"
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if Path(frame.filename) == path]
    return f"{message} (line {frames[-1].lineno})" if frames else message


def parse_model_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``["hidden=64", "size=1.3b", "bias=true"]`` -> ``{"hidden": 64, "size": "1.3b", "bias": True}``."""
    result: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise AutoplanError(f"--model-arg {pair!r} must look like key=value (e.g. --model-arg hidden=1024)")
        result[key.strip()] = _convert(text.strip())
    return result


def _convert(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _accepted_kwargs(function: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return {key: value for key, value in kwargs.items() if key in names}


def _named_parameters(function: Callable[..., Any]) -> set[str]:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds}


def check_model_args(model_file: ModelFile, model_args: dict[str, Any]) -> None:
    """Every ``--model-arg`` must be a named parameter of build_model or example_inputs."""
    known = _named_parameters(model_file.build_model) | (_named_parameters(model_file.example_inputs) - {"batch_size"})
    if model_file.example_targets is not None:
        known |= _named_parameters(model_file.example_targets) - {"batch_size"}
    unknown = sorted(set(model_args) - known)
    if unknown:
        raise AutoplanError(
            f"--model-arg {unknown[0]} is not a parameter of build_model or example_inputs in {model_file.path} "
            f"(they take: {', '.join(sorted(known)) or 'nothing'})"
        )


def instantiate(
    model_file: ModelFile, *, batch_size: int, model_args: dict[str, Any], on_meta: bool = True
) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """Build the model and one step's inputs; on the meta device unless ``on_meta`` is False."""
    if batch_size <= 0:
        raise AutoplanError(f"--batch-size must be a positive integer, got {batch_size}")
    check_model_args(model_file, model_args)
    device = torch.device("meta") if on_meta else torch.device("cpu")
    with device:
        model = _call(
            model_file, "build_model", model_file.build_model, **_accepted_kwargs(model_file.build_model, model_args)
        )
        if not isinstance(model, torch.nn.Module):
            raise AutoplanError(f"build_model in {model_file.path} returned {type(model).__name__}, not an nn.Module")
    return model, instantiate_inputs(model_file, batch_size=batch_size, model_args=model_args, on_meta=on_meta)


def build_kwargs(model_file: ModelFile, model_args: dict[str, Any]) -> dict[str, Any]:
    """The model arguments ``build_model`` takes (the others are for ``example_inputs``/``example_targets``)."""
    return _accepted_kwargs(model_file.build_model, model_args)


def instantiate_inputs(
    model_file: ModelFile, *, batch_size: int, model_args: dict[str, Any], on_meta: bool = True
) -> tuple[Any, ...]:
    """One step's forward inputs from ``example_inputs`` at ``batch_size`` rows."""
    with torch.device("meta") if on_meta else torch.device("cpu"):
        inputs = _call(
            model_file,
            "example_inputs",
            model_file.example_inputs,
            batch_size,
            **_accepted_kwargs(model_file.example_inputs, model_args),
        )
    return _as_tuple(inputs, model_file, "example_inputs")


def instantiate_targets(
    model_file: ModelFile, *, batch_size: int, model_args: dict[str, Any], on_meta: bool = True
) -> tuple[Any, ...]:
    """One step's targets from ``example_targets`` (``()`` when the file defines none)."""
    if model_file.example_targets is None:
        return ()
    device = torch.device("meta") if on_meta else torch.device("cpu")
    with device:
        targets = _call(
            model_file,
            "example_targets",
            model_file.example_targets,
            batch_size,
            **_accepted_kwargs(model_file.example_targets, model_args),
        )
    targets = _as_tuple(targets, model_file, "example_targets")
    if not targets or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in targets):
        raise AutoplanError(
            f"example_targets in {model_file.path} must return a tensor or a tuple of tensors with a batch dim"
        )
    return targets


def _as_tuple(values: Any, model_file: ModelFile, name: str) -> tuple[Any, ...]:
    if isinstance(values, torch.Tensor):
        return (values,)
    if not isinstance(values, tuple | list):
        raise AutoplanError(f"{name} in {model_file.path} returned {type(values).__name__}: return a tuple of tensors")
    return tuple(values)


def _call(model_file: ModelFile, name: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except TypeError as error:
        if "unexpected keyword argument" in str(error) or "positional argument" in str(error):
            raise AutoplanError(
                f"{name} in {model_file.path} does not accept these arguments ({error}); check --model-arg"
            ) from None
        raise AutoplanError(f"{name} in {model_file.path} raised {_describe(error, model_file.path)}") from None
    except Exception as error:
        raise AutoplanError(f"{name} in {model_file.path} raised {_describe(error, model_file.path)}") from None
