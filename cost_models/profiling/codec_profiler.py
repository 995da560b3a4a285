"""Measured encode and decode time of the gathered gradient syncs' compressors, fitted per sync and stored on disk.

``plan profile`` hands :func:`measure_codecs` one :data:`CodecFactory` per gradient sync (its label: ``topk:0.01``,
``qsgd:16``, …; the cli builds them from :func:`executors.compressed_sync.timed_codec`, which this package may not
import). For each of :data:`DEFAULT_SIZES` elements (a ``numel / 64 × 64`` fp32 gradient of random normals) the
factory gives ``encode()`` (the rank's side of one gradient: error feedback or DGC's momentum included, the payload
written to bytes) and ``decode()`` (one received payload read from bytes and added into the sum); each is run
``warmup`` times untimed, then ``repeats`` times, and the median of ``time.perf_counter`` is kept (one thread, as
:mod:`cost_models.profiling.profiler` times operators). :func:`fit_line` fits ``seconds = a + b·numel`` to each by least
squares (:class:`Line`, both clamped at 0), giving one :class:`CodecFit` per sync.

Storage (:class:`CodecCache`): a JSON file beside the operator cache, ``codecs-<device>.json`` in the same folder
(:func:`codec_cache_path`; the operator cache's format is untouched): ``{"version": 1, "entries": {device_key:
{label: {"encode": [a, b], "decode": [a, b], "sizes": [...]}}}}``, keyed like the operator cache
(:func:`cost_models.profiling.profiler.device_key` at one thread), merged and written atomically. The planner reads it
with :func:`load_codec_fits` (``--cost-model profiled``: :func:`planner.costing.setup.make_codec_fits`) and prices the
syncs it has fits for with them (:func:`planner.costing.sync.gathered.gathered_compute_s`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cost_models.profiling.profiler import default_cache_path, device_key
from planner.atomic_file import write_text_atomic
from planner.errors import warn

CODEC_CACHE_VERSION = 1
DEFAULT_SIZES = (2**12, 2**16, 2**20)  # gradient elements timed per sync (a 4K bias to a 1M-element matrix)
COLUMNS = 64  # the timed gradient is numel / COLUMNS rows of COLUMNS (1-bit SGD's column scales see columns)

# (gradient) -> (encode, decode): one sync's two timed parts for that gradient
CodecFactory = Callable[[torch.Tensor], tuple[Callable[[], Any], Callable[[], Any]]]


@dataclass(frozen=True, kw_only=True)
class Line:
    """``seconds = fixed_s + per_element_s · numel``."""

    fixed_s: float
    per_element_s: float

    def __call__(self, numel: int) -> float:
        return self.fixed_s + self.per_element_s * numel


@dataclass(frozen=True, kw_only=True)
class CodecFit:
    """One sync's measured encode (per gradient) and decode (per received payload), and the sizes timed."""

    encode: Line
    decode: Line
    sizes: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "encode": [self.encode.fixed_s, self.encode.per_element_s],
            "decode": [self.decode.fixed_s, self.decode.per_element_s],
            "sizes": list(self.sizes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CodecFit:
        lines = []
        for name in ("encode", "decode"):
            fixed_s, per_element_s = (float(value) for value in data[name])
            if not (fixed_s >= 0 and per_element_s >= 0):  # also refuses NaN
                raise ValueError(f"invalid {name} fit {data[name]!r}")
            lines.append(Line(fixed_s=fixed_s, per_element_s=per_element_s))
        return cls(encode=lines[0], decode=lines[1], sizes=tuple(int(size) for size in data["sizes"]))


def fit_line(sizes: Sequence[int], seconds: Sequence[float]) -> Line:
    """Least-squares ``a + b·n`` through ``(sizes, seconds)``, each clamped at 0 (one size: a line through 0)."""
    if len(sizes) == 1:
        return Line(fixed_s=0.0, per_element_s=max(0.0, seconds[0] / sizes[0]))
    mean_n, mean_s = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = max(0.0, sum((n - mean_n) * (s - mean_s) for n, s in zip(sizes, seconds, strict=True)) / spread)
    return Line(fixed_s=max(0.0, mean_s - slope * mean_n), per_element_s=slope)


def median_s(run: Callable[[], Any], *, warmup: int, repeats: int) -> float:
    """The median wall time of ``repeats`` runs of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start_s)
    return statistics.median(samples)


def measure_codec(
    factory: CodecFactory, *, sizes: Sequence[int] = DEFAULT_SIZES, warmup: int = 2, repeats: int = 5
) -> CodecFit:
    """Time one sync's encode and decode at each of ``sizes`` elements (one thread) and fit both (module docstring)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        encode_s, decode_s = [], []
        generator = torch.Generator().manual_seed(0)
        for numel in sizes:
            grad = torch.randn(max(1, numel // COLUMNS), COLUMNS, generator=generator)
            encode, decode = factory(grad)
            encode_s.append(median_s(encode, warmup=warmup, repeats=repeats))
            decode_s.append(median_s(decode, warmup=warmup, repeats=repeats))
    finally:
        torch.set_num_threads(threads)
    timed = [max(1, numel // COLUMNS) * COLUMNS for numel in sizes]
    return CodecFit(encode=fit_line(timed, encode_s), decode=fit_line(timed, decode_s), sizes=tuple(timed))


def measure_codecs(
    factories: Mapping[str, CodecFactory], *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5
) -> dict[str, CodecFit]:
    """:func:`measure_codec` of every sync, by label."""
    return {label: measure_codec(factory, sizes=sizes, repeats=repeats) for label, factory in factories.items()}


def codec_cache_path(device: str = "cpu") -> Path:
    """``codecs-<device>.json`` beside the operator cache
    (:func:`cost_models.profiling.profiler.default_cache_path`)."""
    operators = default_cache_path(device)
    return operators.with_name(operators.name.replace("profile-", "codecs-", 1))


class CodecCache:
    """Fits on disk by (device key, sync label); see the module docstring."""

    def __init__(self, path: Path | str | None = None, *, device: str = "cpu") -> None:
        self.path = Path(path) if path is not None else codec_cache_path(device)
        self.key = device_key(device, threads=1)

    def read(self, *, quiet: bool = False) -> dict[str, dict[str, CodecFit]]:
        """Every device key's fits (empty when there is no file; an unreadable one is warned about and ignored)."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != CODEC_CACHE_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {CODEC_CACHE_VERSION}")
            return {
                str(key): {str(label): CodecFit.from_json(fit) for label, fit in table.items()}
                for key, table in data["entries"].items()
            }
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            if not quiet:
                warn(f"ignoring unreadable compressor timings {self.path}: {type(error).__name__}: {error}")
            return {}

    def fits(self) -> dict[str, CodecFit]:
        """This device's fits, by sync label."""
        return self.read().get(self.key, {})

    def save(self, fits: Mapping[str, CodecFit]) -> None:
        """Merge ``fits`` into this device's entry of the file and replace it atomically."""
        entries = self.read(quiet=True)
        entries.setdefault(self.key, {}).update(fits)
        data = {
            "version": CODEC_CACHE_VERSION,
            "entries": {key: {label: fit.to_json() for label, fit in table.items()} for key, table in entries.items()},
        }
        write_text_atomic(self.path, json.dumps(data, indent=1, sort_keys=True), what="compressor timings")


def load_codec_fits(device: str = "cpu") -> dict[str, CodecFit]:
    """The fits ``plan profile`` stored for this machine's ``device`` (empty: none measured)."""
    return CodecCache(device=device).fits()
