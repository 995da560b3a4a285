"""``train.py --export-hf DIR``: the trained model as safetensors, with the model's own parameter names.

:func:`export_parallel_model` gathers every parameter whole on rank 0
(:meth:`executors.training.parallel_model.ParallelModel.full_state_dict`: shards and pipeline stages put back
together), loads them into a freshly built copy of the user's model and writes it (:func:`write_model`);
:func:`export_checkpoint` does the same in one process from a checkpoint directory ``DIR/step-N``
(:mod:`executors.training.checkpoint`: DCP reshards its shards into whole tensors on load).

:func:`write_model` writes, for a model that is or wraps a Hugging Face ``transformers.PreTrainedModel``
(:func:`find_pretrained`: the model itself, or its first submodule that is one, e.g. a wrapper returning the
logits), what ``save_pretrained`` writes: ``config.json`` and ``model.safetensors`` (sharded with an index when
large) with the names relative to that model and tied weights written once, as ``from_pretrained`` expects.
For any other model it writes ``model.safetensors`` of its state dict (``safetensors.torch.save_model``: tensors
that share memory, tied weights, written once). Buffers come from the fresh build: the plan trains parameters,
so a buffer the forward updates (batch-norm running statistics) is written as the model builds it.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from executors.training.parallel_model import ParallelModel
from planner.errors import AutoplanError

MODEL_FILE_NAME = "model.safetensors"


def check_safetensors() -> None:
    """``--export-hf`` writes with the ``safetensors`` package (transformers installs it); one line when missing."""
    if importlib.util.find_spec("safetensors") is None:
        raise AutoplanError("--export-hf needs the safetensors package, not installed here: pip install safetensors")


def find_pretrained(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The ``transformers.PreTrainedModel`` in ``model`` and its name prefix (``""``, or ``"model."`` for a
    wrapper holding it as ``self.model``); None for a model with none, or without transformers installed."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return (f"{name}." if name else "", module)
    return None


def load_whole_parameters(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy ``params`` (the model's parameter names, whole tensors) into ``model``; every parameter must be there."""
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    unknown = sorted(set(params) - set(own))
    if missing or unknown:
        raise AutoplanError(
            f"the exported parameters do not match the model's: missing {missing[:3]}, unknown {unknown[:3]}"
        )
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(params[name].to(dtype=param.dtype, device=param.device))


def write_model(model: nn.Module, out_dir: str | Path) -> Path:
    """Write ``model`` to ``out_dir`` as the module docstring says; returns the directory."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise AutoplanError(f"--export-hf {out}: a file is in the way; name a directory")
    out.mkdir(parents=True, exist_ok=True)
    found = find_pretrained(model)
    if found is not None:
        found[1].save_pretrained(out, safe_serialization=True)
        return out
    from safetensors.torch import save_model

    save_model(model, str(out / MODEL_FILE_NAME))
    return out


def export_parallel_model(parallel: ParallelModel, out_dir: str | Path) -> Path | None:
    """Gather the trained model on rank 0 and write it (a collective: every rank calls it); rank 0 returns the
    directory, the others None."""
    params = parallel.full_state_dict()
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    model, _ = parallel.workload.instantiate(batch_size=1, on_meta=False)
    load_whole_parameters(model, params)
    written = write_model(model, out_dir)
    dist.barrier()
    return written


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, build_model: Callable[[], nn.Module]) -> Path:
    """Write the model saved in the checkpoint directory ``checkpoint`` (``DIR/step-N``, or ``DIR`` for its newest)
    in one process: ``build_model()`` gives the model the parameters load into."""
    import torch.distributed.checkpoint as dcp

    from executors.training.checkpoint import latest_checkpoint

    path = Path(checkpoint)
    if not (path / ".metadata").is_file():
        path = latest_checkpoint(path) or path
    if not (path / ".metadata").is_file():
        raise AutoplanError(f"{checkpoint} is not a checkpoint: name a step-N directory --checkpoint-dir wrote")
    model = build_model()
    state = {f"model.{name}": param.detach().clone() for name, param in model.named_parameters()}
    with warnings.catch_warnings():  # DCP's "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    load_whole_parameters(model, {name.removeprefix("model."): tensor for name, tensor in state.items()})
    return write_model(model, out_dir)
