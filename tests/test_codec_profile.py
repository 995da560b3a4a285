"""``plan profile``'s compressor timings (:mod:`cost_models.profiling.codec_profiler`): measured on this CPU in seconds
at tiny sizes, fitted ``a + b·N``, stored beside the operator cache and read back, and used by the gathered syncs'
price (:func:`planner.costing.sync.gathered.gathered_compute_s`) when the setup has them — the bytes model
otherwise; the plan's notes say which."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from cost_models.compute import RooflineCompute
from cost_models.memory import optimizer_bytes
from cost_models.profiling.codec_profiler import CodecCache, CodecFit, Line, codec_cache_path, fit_line, measure_codecs
from executors.compressed_sync import timed_codec
from planner.cli.main import main
from planner.cli.profile import PROFILED_SYNCS
from planner.costing.overlap import GradEntry
from planner.costing.setup import CostSetup, make_codec_fits
from planner.costing.sync import gathered as gathered_sync
from planner.inter.grad_sync_choice import SyncChoice
from planner.plan import GradSync
from tests.conftest import EXAMPLES

ENTRIES = (GradEntry(name="w", shape=(1024, 1024), axes=(0,)), GradEntry(name="b", shape=(1024,), axes=(0,)))
FIT = CodecFit(
    encode=Line(fixed_s=20e-6, per_element_s=10e-9), decode=Line(fixed_s=5e-6, per_element_s=2e-9), sizes=(64, 128)
)


def _setup(**codec_fits: CodecFit) -> CostSetup:
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    return CostSetup(
        cluster=cluster, compute=RooflineCompute(device=cluster.device), optimizer="adam-mixed", codec_fits=codec_fits
    )


def test_a_line_through_exact_points_is_recovered_and_clamped_at_zero() -> None:
    line = fit_line([100, 200, 400], [1e-5 + 2e-9 * n for n in (100, 200, 400)])
    assert line.fixed_s == pytest.approx(1e-5) and line.per_element_s == pytest.approx(2e-9)
    falling = fit_line([100, 200], [2e-5, 1e-5])  # noise: a negative slope is no cost model
    assert falling.per_element_s == 0.0 and falling.fixed_s == pytest.approx(1.5e-5)


def test_fits_round_trip_through_the_file_and_a_bad_file_is_ignored(tmp_path: Path) -> None:
    cache = CodecCache(tmp_path / "codecs-cpu.json")
    cache.save({"topk:0.01": FIT})
    cache.save({"signsgd": replace(FIT, sizes=(1,))})  # merged, not replaced
    assert CodecCache(tmp_path / "codecs-cpu.json").fits() == {"topk:0.01": FIT, "signsgd": replace(FIT, sizes=(1,))}
    data = json.loads((tmp_path / "codecs-cpu.json").read_text())
    assert data["version"] == 1 and list(data["entries"]) == [cache.key] and cache.key.endswith("threads-1")
    (tmp_path / "codecs-cpu.json").write_text(json.dumps({**data, "version": 99}))
    with pytest.warns(UserWarning, match="ignoring unreadable compressor timings"):
        assert CodecCache(tmp_path / "codecs-cpu.json").fits() == {}


def test_a_cpu_measurement_of_every_compressor_at_tiny_sizes_takes_seconds() -> None:
    started = time.perf_counter()
    syncs = [GradSync.parse(form) for form in PROFILED_SYNCS]
    factories = {grad_sync.label: lambda grad, g=grad_sync: timed_codec(g, grad) for grad_sync in syncs}
    fits = measure_codecs(factories, sizes=(256, 1024), repeats=2)
    assert time.perf_counter() - started < 30
    assert set(fits) == set(PROFILED_SYNCS)
    for fit in fits.values():
        assert fit.sizes == (256, 1024)
        assert fit.encode(1024) > 0 and fit.decode(1024) > 0 and math.isfinite(fit.encode(2**20))


def test_the_measured_fit_prices_the_sync_and_the_bytes_model_the_rest() -> None:
    bandwidth_only = _setup()
    measured = _setup(**{"qsgd:16": FIT})
    qsgd, terngrad = GradSync.parse("qsgd:16"), GradSync.parse("terngrad")
    for grad_sync in (qsgd, terngrad):  # the bytes model, as before: bytes at the streaming bandwidth + launches
        device = bandwidth_only.cluster.device
        moved, kernels = map(
            sum,
            zip(*(gathered_sync.gradient_compute(e, grad_sync, devices=4, itemsize=2) for e in ENTRIES), strict=True),
        )
        by_bytes = moved / (device.memory_bandwidth * device.memory_efficiency) + kernels * device.kernel_overhead_s
        assert gathered_sync.gathered_compute_s(ENTRIES, grad_sync, devices=4, setup=bandwidth_only) == by_bytes
    assert gathered_sync.gathered_compute_s(ENTRIES, terngrad, devices=4, setup=measured) == by_bytes  # no fit
    device, itemsize = measured.cluster.device, optimizer_bytes("adam-mixed").grads
    timed = sum(FIT.encode(e.numel) + 4 * FIT.decode(e.numel) for e in ENTRIES)
    untimed_bytes = sum((itemsize + 4 + gathered_sync.DENSE_FINISH_BYTES + itemsize) * e.numel for e in ENTRIES)
    by_hand = (
        device.shared_slowdown * timed
        + untimed_bytes / (device.memory_bandwidth * device.memory_efficiency)
        + 2 * 3 * device.kernel_overhead_s
    )
    assert gathered_sync.gathered_compute_s(ENTRIES, qsgd, devices=4, setup=measured) == pytest.approx(by_hand)


def test_the_notes_say_how_the_compressor_was_priced() -> None:
    choice = SyncChoice(grad_sync=GradSync.parse("qsgd:16"), step_s=1.0, state_bytes=0.0, exact_step_s=2.0)
    assert "plan profile measured" in choice.note(_setup(**{"qsgd:16": FIT}))
    assert "streaming bandwidth (not measured)" in choice.note(_setup(**{"topk:0.01": FIT}))
    exact = SyncChoice(grad_sync=GradSync.parse("bf16"), step_s=1.0, state_bytes=0.0, exact_step_s=2.0)
    assert "measured" not in exact.note(_setup())


def test_plan_profile_times_stores_and_prints_the_compressors(capsys) -> None:
    path = codec_cache_path("cpu")
    path.unlink(missing_ok=True)
    args = ["profile", str(EXAMPLES / "mlp.py"), "--batch-size", "4", "--model-arg", "hidden=64", "--repeats", "1"]
    assert main([*args, "--codec-sizes", "256,1024", "--grad-sync", "topk:0.1"]) == 0
    out = capsys.readouterr().out
    assert "gradient compressors, measured here" in out and "topk:0.1 " in out and "dgc:0.01" in out
    stored = CodecCache(path).fits()
    assert set(stored) == {*PROFILED_SYNCS, "topk:0.1"}
    cluster = load_cluster("local-cpu", num_nodes=1, devices_per_node=2)
    assert make_codec_fits(cluster, cost_model="profiled") == stored
    assert make_codec_fits(cluster, cost_model="roofline") == {}
