"""Measured forward and backward time of each operator of an :class:`OpGraph` on this device.

Method, per distinct ``OpNode.signature()`` (identical layers are timed once):

* Inputs are random tensors built from ``node.input_metas`` (floating: ``torch.randn``;
  integer: zeros, which are valid indices for embedding/gather/index_select; bool: random
  bools), put back into the call with :func:`planner.ir.node_call.bind_call`. Floating inputs
  require grad, as in training, so the forward time includes autograd's bookkeeping.
* ``warmup`` untimed forward(+backward) runs, then ``repeats`` timed ones; each reported time
  is the **median** over the repeats of ``time.perf_counter`` wall time (on ``cuda*`` devices
  bracketed by ``torch.cuda.synchronize``).
* Backward time measures only ``torch.autograd.grad(floating outputs, floating inputs,
  grad_outputs=random like outputs, allow_unused=True)`` on the graph of that repeat's forward
  call: the gradients of the operator's inputs (parameters included), not the forward.
  A node with no floating input or no differentiable output has ``bwd_s = 0``.
* View nodes (``NodeKind.VIEW``) cost 0 and are not run. A node whose working set
  (:func:`node_memory_bytes`) exceeds ``max_bytes``, or that raises while running, is left out
  of the table (the caller falls back to the roofline) and reported in
  :attr:`ProfileResult.skipped`.

Threads: the profiler never calls ``torch.set_num_threads``; it measures with whatever thread
count the caller set (``plan profile`` runs one thread per process to mimic one device per
core), and the thread count is part of the cache key.

Cache (:class:`ProfileCache`): a JSON file ``{"version": 1, "entries": {device_key:
{signature: {"fwd_s": .., "bwd_s": ..}}}}``, keyed by (:func:`device_key`, signature) where the
device key names the device, CPU model, torch version and thread count. Default location
``$AUTOPLAN_CACHE_DIR/profile-<device>.json``, else ``~/.cache/autoplan/profile-<device>.json``.
It is loaded once, saved atomically (temporary file + ``os.replace``, merged with what is on
disk) at the end of :func:`profile_graph`; an unreadable file is ignored with a warning.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from cost_models.compute import NodeTime
from cost_models.units import GIB
from planner.atomic_file import write_text_atomic
from planner.errors import AutoplanError, warn
from planner.ir.graph import NodeKind, OpGraph, OpNode, TensorMeta
from planner.ir.node_call import bind_call, resolve_target, torch_dtype

DEFAULT_MAX_BYTES = 2 * GIB
CACHE_VERSION = 1
CACHE_DIR_ENV = "AUTOPLAN_CACHE_DIR"

ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """What :func:`profile_graph` measured.

    ``times``: signature -> NodeTime for every signature that was measured, read from the
    cache, or is a view (zero); ``skipped``: node name -> one-line reason for every node left
    out of ``times`` (too large, or failed to run); ``cached_hits``: signatures served from the
    cache; ``measured``: signatures timed in this call.
    """

    times: Mapping[str, NodeTime]
    skipped: Mapping[str, str] = field(default_factory=dict)
    cached_hits: int = 0
    measured: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "times", MappingProxyType(dict(self.times)))
        object.__setattr__(self, "skipped", MappingProxyType(dict(self.skipped)))


def device_key(device: str, *, threads: int | None = None) -> str:
    """What a measurement depends on besides the signature: device, CPU, torch, threads (None: the current count)."""
    threads = torch.get_num_threads() if threads is None else threads
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        return f"{device}:{name}:torch-{torch.__version__}:threads-{threads}"
    cpu = platform.processor() or platform.machine()
    return f"{device}:{cpu}:torch-{torch.__version__}:threads-{threads}"


def default_cache_path(device: str) -> Path:
    """``$AUTOPLAN_CACHE_DIR/profile-<device>.json`` or ``~/.cache/autoplan/profile-<device>.json``."""
    directory = os.environ.get(CACHE_DIR_ENV)
    root = Path(directory) if directory else Path.home() / ".cache" / "autoplan"
    safe_device = "".join(char if char.isalnum() else "-" for char in device)
    return root / f"profile-{safe_device}.json"


class ProfileCache:
    """Measured times on disk, keyed by (device key, signature); see the module docstring."""

    def __init__(self, path: Path | str | None = None, *, device: str = "cpu") -> None:
        self.path = Path(path) if path is not None else default_cache_path(device)
        self._entries: dict[str, dict[str, NodeTime]] = _read_cache_file(self.path)
        self._dirty = False

    def get(self, key: str, signature: str) -> NodeTime | None:
        return self._entries.get(key, {}).get(signature)

    def put(self, key: str, signature: str, node_time: NodeTime) -> None:
        self._entries.setdefault(key, {})[signature] = node_time
        self._dirty = True

    def __len__(self) -> int:
        return sum(len(table) for table in self._entries.values())

    def save(self) -> None:
        """Merge with the file's current content and replace it atomically; no-op if unchanged."""
        if not self._dirty:
            return
        merged = _read_cache_file(self.path, quiet=True)
        for key, table in self._entries.items():
            merged.setdefault(key, {}).update(table)
        _write_atomically(self.path, _cache_json(merged))
        self._dirty = False


def _read_cache_file(path: Path, *, quiet: bool = False) -> dict[str, dict[str, NodeTime]]:
    if not path.exists():
        return {}
    try:
        return _parse_cache(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        if not quiet:
            warn(f"ignoring unreadable profile cache {path}: {type(error).__name__}: {error}")
        return {}


def _parse_cache(data: Any) -> dict[str, dict[str, NodeTime]]:
    if data.get("version") != CACHE_VERSION:
        raise ValueError(f"version {data.get('version')!r}, expected {CACHE_VERSION}")
    entries: dict[str, dict[str, NodeTime]] = {}
    for key, table in data["entries"].items():
        entries[str(key)] = {str(signature): _parse_time(value) for signature, value in table.items()}
    return entries


def _parse_time(value: Any) -> NodeTime:
    fwd_s, bwd_s = float(value["fwd_s"]), float(value["bwd_s"])
    if not (math.isfinite(fwd_s) and math.isfinite(bwd_s)) or fwd_s < 0 or bwd_s < 0:
        raise ValueError(f"invalid time {value!r}")
    return NodeTime(fwd_s=fwd_s, bwd_s=bwd_s)


def _cache_json(entries: Mapping[str, Mapping[str, NodeTime]]) -> dict[str, Any]:
    return {
        "version": CACHE_VERSION,
        "entries": {
            key: {signature: {"fwd_s": t.fwd_s, "bwd_s": t.bwd_s} for signature, t in table.items()}
            for key, table in entries.items()
        },
    }


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True), what="profile cache")


def node_memory_bytes(node: OpNode) -> int:
    """Working set of one profiling run: inputs + outputs, doubled for their gradients."""
    tensors_bytes = sum(meta.nbytes for meta in (*node.input_metas, *node.outputs))
    has_floating_input = any(meta.is_floating for meta in node.input_metas)
    return 2 * tensors_bytes if has_floating_input else tensors_bytes


def profile_graph(
    graph: OpGraph,
    *,
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    cache: ProfileCache | None = None,
    progress: ProgressCallback | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> ProfileResult:
    """Time forward and backward of every distinct node signature of ``graph`` on ``device``.

    ``cache=None`` measures everything and stores nothing; a cache is saved at the end, also
    when interrupted. ``progress(done, total)`` is called after each distinct signature.
    See the module docstring for the method.
    """
    _check_options(device=device, warmup=warmup, repeats=repeats)
    key = device_key(device)
    groups = _group_by_signature(graph)
    times: dict[str, NodeTime] = {}
    skipped: dict[str, str] = {}
    cached_hits = measured = 0
    try:
        for done, (signature, nodes) in enumerate(groups.items(), start=1):
            node = nodes[0]
            if node.kind == NodeKind.VIEW:
                times[signature] = NodeTime(fwd_s=0.0, bwd_s=0.0)
            elif cache is not None and (cached := cache.get(key, signature)) is not None:
                times[signature] = cached
                cached_hits += 1
            else:
                outcome = _measure_or_reason(node, device=device, warmup=warmup, repeats=repeats, max_bytes=max_bytes)
                if isinstance(outcome, NodeTime):
                    times[signature] = outcome
                    measured += 1
                    if cache is not None:
                        cache.put(key, signature, outcome)
                else:
                    skipped.update({skipped_node.name: outcome for skipped_node in nodes})
            if progress is not None:
                progress(done, len(groups))
    finally:  # an interrupted run keeps what it measured
        if cache is not None:
            cache.save()
    return ProfileResult(times=times, skipped=skipped, cached_hits=cached_hits, measured=measured)


@dataclass(frozen=True, kw_only=True)
class NodeMeasurer:
    """``measurer(node)``: one node's time, measured on first sight (one thread) and cached on disk.

    For :attr:`ProfiledCompute.measure`: the graphs at other microbatch sizes have nodes of other
    signatures than the profiled full-batch graph. None when the node cannot be timed (roofline)."""

    cache: ProfileCache | None
    device: str = "cpu"
    warmup: int = 2
    repeats: int = 5
    max_bytes: int = DEFAULT_MAX_BYTES

    def __call__(self, node: OpNode) -> NodeTime | None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            key = device_key(self.device)
            if self.cache is not None and (cached := self.cache.get(key, node.signature())) is not None:
                return cached
            outcome = _measure_or_reason(
                node, device=self.device, warmup=self.warmup, repeats=self.repeats, max_bytes=self.max_bytes
            )
            if not isinstance(outcome, NodeTime):
                return None
            if self.cache is not None:
                self.cache.put(key, node.signature(), outcome)
                self.cache.save()
            return outcome
        finally:
            torch.set_num_threads(threads)


def _check_options(*, device: str, warmup: int, repeats: int) -> None:
    if warmup < 0:
        raise AutoplanError(f"profiling warm-up runs must be 0 or more, got {warmup}")
    if repeats < 1:
        raise AutoplanError(f"profiling repeats must be 1 or more, got {repeats}")
    try:
        torch.device(device)
    except RuntimeError as error:
        raise AutoplanError(f"unknown profiling device {device!r}: {error}") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AutoplanError(f"cannot profile on {device!r}: torch sees no CUDA device here")


def _group_by_signature(graph: OpGraph) -> dict[str, list[OpNode]]:
    groups: dict[str, list[OpNode]] = {}
    for node in graph.nodes:
        groups.setdefault(node.signature(), []).append(node)
    return groups


def _measure_or_reason(node: OpNode, *, device: str, warmup: int, repeats: int, max_bytes: int) -> NodeTime | str:
    """The node's time, or a one-line reason why it was not measured."""
    needed_bytes = node_memory_bytes(node)
    if needed_bytes > max_bytes:
        return f"needs {needed_bytes / GIB:.2f} GiB to profile, more than the {max_bytes / GIB:.2f} GiB allowed"
    try:
        return _measure_node(node, device=device, warmup=warmup, repeats=repeats)
    except Exception as error:  # any operator failure means "fall back to the roofline"
        first_line = (str(error).strip().splitlines() or [""])[0]
        return f"failed to run: {type(error).__name__}: {first_line}"


def _measure_node(node: OpNode, *, device: str, warmup: int, repeats: int) -> NodeTime:
    function = resolve_target(node.target)
    inputs = [_random_tensor(meta, device=device) for meta in node.input_metas]
    args, kwargs = bind_call(node.args, node.kwargs, inputs, device=device)
    wrt = [tensor for tensor in inputs if tensor.requires_grad]
    synchronize = _synchronizer(device)
    forward_samples: list[float] = []
    backward_samples: list[float] = []
    with torch.enable_grad():
        for run in range(warmup + repeats):
            fwd_s, bwd_s = _run_once(function, args, kwargs, wrt, synchronize)
            if run >= warmup:
                forward_samples.append(fwd_s)
                backward_samples.append(bwd_s)
    return NodeTime(fwd_s=statistics.median(forward_samples), bwd_s=statistics.median(backward_samples))


def _run_once(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    wrt: Sequence[torch.Tensor],
    synchronize: Callable[[], None],
) -> tuple[float, float]:
    """One forward (timed) then, if anything is differentiable, one timed autograd.grad."""
    synchronize()
    start_s = time.perf_counter()
    result = function(*args, **kwargs)
    synchronize()
    fwd_s = time.perf_counter() - start_s
    differentiable = _differentiable_outputs(result)
    if not wrt or not differentiable:
        return fwd_s, 0.0
    grad_outputs = [torch.randn_like(output) for output in differentiable]
    synchronize()
    start_s = time.perf_counter()
    torch.autograd.grad(differentiable, wrt, grad_outputs=grad_outputs, allow_unused=True)
    synchronize()
    return fwd_s, time.perf_counter() - start_s


def _differentiable_outputs(result: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(result)
    return [
        value for value in flat if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad
    ]


def _random_tensor(meta: TensorMeta, *, device: str) -> torch.Tensor:
    dtype = torch_dtype(meta.dtype)
    if meta.is_floating:
        return torch.randn(meta.shape, dtype=dtype, device=device).requires_grad_(True)
    if dtype == torch.bool:
        return torch.randint(0, 2, meta.shape, device=device).to(torch.bool)
    return torch.zeros(meta.shape, dtype=dtype, device=device)


def _synchronizer(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        cuda_device = torch.device(device)
        return lambda: torch.cuda.synchronize(cuda_device)
    return lambda: None
