"""What every rank sets up before it runs a plan: the process group, the model and its graphs.

:func:`init_distributed` joins the process group that ``torchrun`` describes in the environment,
with a timeout on every collective (so a dead peer turns into an error, not a hang).
:func:`load_workload` rebuilds the model from the plan's model file with a fixed seed (every rank
gets the same weights and the same batch), captures it on the meta device and checks the
fingerprint against the plan's before any step; :meth:`Workload.build` gives the model the constants the
capture lifted out of its forward (:func:`attach_constants`); :meth:`Workload.graph_at` captures the graph at
the batch size a stage will see (a microbatch, or a data-parallel rank's share), which must have
the same nodes as the planned graph.

A step's *batch* is the tuple ``(*inputs, *targets)``: the forward inputs, then the model file's
targets (none when it defines no ``example_targets``). :meth:`Workload.model_inputs` and
:meth:`Workload.loss_data` cut a (micro)batch into what ``forward`` and ``loss_fn`` receive;
pipelines carry the loss's data to the last stage under the names :meth:`Workload.loss_names`
gives (graph input names, or ``target.0``, ``target.1``, ... for targets).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from executors.graph_module import check_same_nodes
from executors.precision import Precision
from executors.semantics import without_dropout
from planner.errors import AutoplanError
from planner.ir.capture import capture
from planner.ir.graph import OpGraph, TensorMeta
from planner.ir.model_file import ModelFile, instantiate, instantiate_inputs, instantiate_targets, load_model_file
from planner.ir.node_call import tensor_meta
from planner.plan import Plan

BACKENDS = ("gloo", "nccl")


def init_distributed(*, backend: str, timeout_s: float) -> tuple[int, int]:
    """Join the job torchrun started; returns ``(rank, world_size)``."""
    if backend not in BACKENDS:
        raise AutoplanError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise AutoplanError("--backend nccl needs CUDA GPUs; use --backend gloo on CPU")
    if "RANK" not in os.environ:
        raise AutoplanError("no torchrun environment (RANK, WORLD_SIZE): start with `plan run` or torchrun")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def default_loss(output: Any, inputs: Sequence[Any]) -> torch.Tensor:
    """The loss when the model file defines none: the mean of the output's first tensor (in a tuple, a dict, ...)."""
    first = next(leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor))
    return first.float().mean()


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One rank's copy of the model, its inputs and the planned graph (built complete by :func:`load_workload`;
    ``_graphs`` caches the graph at other microbatch sizes)."""

    plan: Plan
    model_file: ModelFile
    model_args: dict[str, Any]
    seed: int
    device: str
    graph: OpGraph
    loss_fn: Callable[[Any, Sequence[Any]], torch.Tensor]
    uses_inputs_in_loss: bool
    num_inputs: int = 0
    dropout: bool = True  # False: every dropout probability is 0 (parity checks), see executors.semantics
    _graphs: dict[int, OpGraph] = field(default_factory=dict)
    target_metas: tuple[TensorMeta, ...] = ()  # the targets at the plan's batch
    precision: Precision = field(default_factory=lambda: Precision(name="fp32"))  # see executors.precision
    build_fn: Callable[[], torch.nn.Module] | None = None  # the program's own build_model (None: the model file's)

    def build(self) -> tuple[torch.nn.Module, tuple[Any, ...]]:
        """The model with the seeded initial weights and one step's batch ``(*inputs, *targets)``, on
        this rank's device."""
        torch.manual_seed(self.seed)
        model, inputs = self.instantiate(batch_size=self.plan.batch_size, on_meta=False)
        attach_constants(model, self.graph)
        targets = instantiate_targets(
            self.model_file, batch_size=self.plan.batch_size, model_args=self.model_args, on_meta=False
        )
        moved = tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in (*inputs, *targets))
        return model.to(self.device), moved

    def instantiate(self, *, batch_size: int, on_meta: bool) -> tuple[torch.nn.Module, tuple[Any, ...]]:
        """The model (the program's ``build_model`` when it has one) and inputs at ``batch_size`` rows."""
        return _instantiate(self.model_file, self.model_args, self.build_fn, batch_size=batch_size, on_meta=on_meta)

    def model_inputs(self, batch: Sequence[Any]) -> tuple[Any, ...]:
        """What ``forward`` takes from a (micro)batch."""
        return tuple(batch[: self.num_inputs])

    def loss_data(self, batch: Sequence[Any]) -> tuple[Any, ...]:
        """What ``loss_fn`` takes besides the output: the targets, or (older files) the inputs."""
        return tuple(batch[self.num_inputs :]) if self.model_file.has_targets else tuple(batch[: self.num_inputs])

    def loss(self, output: Any, batch: Sequence[Any]) -> torch.Tensor:
        return self.loss_fn(output, self.loss_data(batch))

    def loss_names(self, graph: OpGraph) -> tuple[str, ...]:
        """The values a pipeline carries to the loss: targets, the graph inputs, or nothing."""
        if self.model_file.has_targets:
            return self.target_names()
        return tuple(v.name for v in graph.inputs) if self.uses_inputs_in_loss else ()

    def target_names(self) -> tuple[str, ...]:
        return tuple(f"target.{i}" for i in range(len(self.target_metas)))

    def value_meta(self, graph: OpGraph, name: str, *, batch_size: int) -> TensorMeta:
        """A boundary value's meta in ``graph`` (captured at ``batch_size`` rows): a node's output, a graph
        input, or a target (cut along the batch like the inputs)."""
        if name.startswith("target.") and not graph.has_node(name):
            meta = self.target_metas[int(name.removeprefix("target."))]
            return replace(meta, shape=(meta.shape[0] * batch_size // self.plan.batch_size, *meta.shape[1:]))
        return graph.node(name).output if graph.has_node(name) else graph.value(name).meta

    def graph_at(self, batch_size: int) -> OpGraph:
        """The model's graph at ``batch_size`` rows, with the planned graph's node names."""
        if batch_size == self.plan.batch_size:
            return self.graph
        if batch_size not in self._graphs:
            graph = _capture(*self.instantiate(batch_size=batch_size, on_meta=True), tracer=self.plan.model.tracer)
            graph = graph if self.dropout else without_dropout(graph)  # as the planned graph was
            check_same_nodes(self.graph, graph, what=f"batch {batch_size}")
            self._graphs[batch_size] = graph
        return self._graphs[batch_size]


def load_workload(
    plan: Plan,
    *,
    seed: int,
    device: str,
    dropout: bool = True,
    precision: Precision | None = None,
    build_fn: Callable[[], torch.nn.Module] | None = None,
    model_file: ModelFile | None = None,
    loss_fn: Callable[[Any, Sequence[Any]], torch.Tensor] | None = None,
) -> Workload:
    """Rebuild the plan's model and check it is the model the plan was made for; ``dropout=False``
    runs it with every dropout probability 0 (what ``--check-parity`` compares); ``loss_fn`` replaces the
    model file's."""
    if plan.model.file is None:
        raise AutoplanError("the plan has no model file (it was planned from Python): plan it with the `plan` command")
    model_file = model_file or load_model_file(plan.model.file)  # a program passes the file it already imported
    model_args = dict(plan.model.args)
    model, inputs = _instantiate(model_file, model_args, build_fn, batch_size=plan.batch_size, on_meta=True)
    graph = _capture(model, inputs, tracer=plan.model.tracer)
    targets = instantiate_targets(model_file, batch_size=plan.batch_size, model_args=model_args)
    found = graph.fingerprint()
    if found != plan.model.fingerprint:
        raise AutoplanError(
            f"model fingerprint mismatch: the plan was made for model {plan.model.fingerprint}, but "
            f"{plan.model.file} with {dict(plan.model.args)} builds {found}; re-plan the model (if the file is "
            "unchanged, its graph depends on the process: code that iterates a set of strings, such as "
            "ModernBERT's rotary embeddings, orders by PYTHONHASHSEED; set PYTHONHASHSEED=0 to plan and run)"
        )
    return Workload(
        plan=plan,
        model_file=model_file,
        model_args=model_args,
        seed=seed,
        device=device,
        graph=graph if dropout else without_dropout(graph),
        loss_fn=loss_fn or model_file.loss_fn or default_loss,
        uses_inputs_in_loss=model_file.loss_fn is not None,
        num_inputs=len(inputs),
        dropout=dropout,
        target_metas=tuple(tensor_meta(t) for t in targets),
        precision=precision or Precision(name="fp32"),
        build_fn=build_fn,
    )


def attach_constants(model: torch.nn.Module, graph: OpGraph) -> None:
    """The graph's lifted constants (:class:`planner.ir.graph.GraphConstant`) as non-persistent buffers of
    ``model`` under their graph names, so every runner finds them by name beside the model's own buffers (and
    they move with the model; checkpoints do not hold them)."""
    for constant in graph.constants:
        path, _, attribute = constant.name.rpartition(".")
        try:
            owner = model.get_submodule(path)
        except AttributeError:
            owner = None
        if owner is None or (hasattr(owner, attribute) and attribute not in owner._buffers):
            raise AutoplanError(
                f"the captured graph holds a constant {constant.name} that torch.export lifted out of the forward, "
                "but the model has no free place of that name for it; make the tensor a buffer of its module "
                "(register_buffer) instead of creating it in forward"
            )
        values = torch.tensor(constant.values, dtype=getattr(torch, constant.meta.dtype))
        owner.register_buffer(attribute, values.reshape(constant.meta.shape), persistent=False)


def _instantiate(
    model_file: ModelFile,
    model_args: dict[str, Any],
    build_fn: Callable[[], torch.nn.Module] | None,
    *,
    batch_size: int,
    on_meta: bool,
) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model (``build_fn``'s when given, else the model file's) and its inputs at ``batch_size`` rows."""
    if build_fn is None:
        return instantiate(model_file, batch_size=batch_size, model_args=model_args, on_meta=on_meta)
    with torch.device("meta") if on_meta else torch.device("cpu"):
        model = build_fn()
    return model, instantiate_inputs(model_file, batch_size=batch_size, model_args=model_args, on_meta=on_meta)


def _capture(model: torch.nn.Module, inputs: Sequence[Any], *, tracer: str) -> OpGraph:
    graph = capture(model, inputs, tracer=tracer)
    if len(graph.inputs) != len([x for x in inputs if isinstance(x, torch.Tensor)]):
        raise AutoplanError(
            f"the captured graph has {len(graph.inputs)} inputs but example_inputs gives {len(inputs)}: "
            "every example input must be a tensor the model reads"
        )
    return graph


def split_batch(inputs: Sequence[Any], *, num_chunks: int, batch_size: int) -> list[tuple[Any, ...]]:
    """The inputs cut into ``num_chunks`` equal pieces along the batch (dim 0 of size ``batch_size``)."""
    pieces: list[list[Any]] = [[] for _ in range(num_chunks)]
    for value in inputs:
        batched = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size
        chunks = value.chunk(num_chunks) if batched else [value] * num_chunks
        for piece, chunk in zip(pieces, chunks, strict=True):
            piece.append(chunk)
    return [tuple(piece) for piece in pieces]


def rank_job(argv: Sequence[str], measure: Callable[[list[str], int], dict[str, Any]]) -> bool:
    """One rank of a measuring job launched as ``OUT COUNT PLAN...``: one thread, a gloo group, ``measure(plans,
    COUNT)`` on every rank, its result written to ``OUT`` by rank 0. True on rank 0."""
    out, count, paths = argv[0], int(argv[1]), list(argv[2:])
    torch.set_num_threads(1)
    init_distributed(backend="gloo", timeout_s=300)
    result = measure(paths, count)
    is_writer = dist.get_rank() == 0
    if is_writer:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
    return is_writer
