"""Lossy gradient syncs train: the loss curve of each stays near the exact plan's.

Each case trains a small residual MLP (``examples/mlp.py``, hidden 32, two blocks, batch 32, AdamW lr 0.01, a new
random batch every step) for :data:`STEPS` steps through the real training loop on gloo ranks, once with exact
gradient sync and once under each lossy choice, all from the same seed
(``tests/lossy_worker.py``): the data-parallel plan (DDP with torch's ``bf16_compress_hook``, ``powerSGD_hook``
and ``post_localSGD_hook`` + ``PeriodicModelAverager``) on two ranks, one per node, and the Megatron (2, 1, 2)
plan on four (the sharded stage's buckets through the same torch hooks, :mod:`executors.parallel.grad_sync`).

Tolerance, fixed before any run: the mean loss over every window of :data:`WINDOW` steps stays within
:data:`TOLERANCE` × the exact run's first-window mean of the exact run's mean over the same window, and every run's
last window is below half of its first (the loss went down).

The same runs on GPT (``examples/gpt.py``, two ranks) and, until 2026-11-28, Hugging Face Llama
(``examples/zoo/hf_llama.py``, four ranks), both tiny, learning counting sequences (``tests/counting_lm.py``: on random
tokens a language model's loss cannot halve), batch 32, the same lr, steps, windows and tolerance (fixed before their
first run, as for the MLP). Llama at world 4 passed bf16 and PowerSGD in every CI run up to 2026-11-28 (PowerSGD's
error feedback on the sharded buckets; bf16 to 2026-11-27); its two runs took 275 s of the 30-minute CI on an idle
machine, so CI keeps the Megatron plan on the MLP only (same hooks, same buckets) and the language model on GPT at
world 2.

PowerSGD of rank 1 was in the first run too and failed that tolerance on both plans (its window means lagged
exact's by up to 0.10 against the 0.06 allowed: rank 1 of a 32 × 32 gradient loses too much), so
:data:`planner.inter.grad_sync_choice.LOSSY_CHOICES`, what ``auto --allow-lossy`` may pick, leaves it out; the
choices here are exactly the ones auto offers (local SGD needs replicas on several nodes: the two-rank case only).

The gathered syncs (:mod:`executors.compressed_sync`) were tried under the same tolerance, unchanged, on 2026-11-27
(largest window gap / allowed, every attempt listed): on the MLP at world 2
top-k 0.1 0.075/0.060 ✗, top-k 0.01 0.139/0.060 ✗, 1-bit 0.050/0.060 ✓, threshold 0.001 diverged (5.27) ✗,
TernGrad 0.038/0.060 ✓, QSGD 4 levels 0.063/0.060 ✗, signSGD 0.022/0.060 ✓; at world 4 (Megatron) top-k 0.1
0.083/0.061 ✗, 1-bit 0.065/0.061 ✗, threshold 0.01 0.076/0.061 ✗, TernGrad 0.031 ✓, QSGD 4 0.044 ✓, QSGD 16 0.005 ✓,
signSGD 0.026 ✓. QSGD 16 was tried after QSGD 4 failed (a choice made on the MLP); GPT at world 2 and Llama at world 4
then passed every one of top-k 0.1, 1-bit, TernGrad, QSGD 16 and signSGD (GPT ≤ 0.007/0.069, Llama ≤ 0.057/0.090).
Auto may pick the three that passed everywhere: TernGrad, QSGD 16 and signSGD (:data:`GATHERED`); the others run
only when forced. CI trains them at world 2 on the MLP (and on GPT too, passing in every CI run, until 2026-11-28,
when GPT kept bf16, PowerSGD and local SGD of period 16 for CI time: the gathered syncs' code is the same on both
models); at world 4 (the MLP and Llama, 110 s a run here) they were trained by hand as listed above and CI keeps
PowerSGD only (bf16 on the MLP's sharded buckets passed in every CI run until 2026-11-28: the same bucket path,
another hook), for CI time.

Stale parameter servers (``ps:S:K``, :mod:`executors.parameter_server`) were tried by hand on 2026-11-27 under the
same tolerance, the data-parallel MLP at world 2 (two nodes, two servers): ``ps:2:1`` 0.078/0.060 ✗, ``ps:2:4``
0.424/0.060 ✗ (the synchronous ``ps:2`` matched exact to the last digit). Auto offers only the synchronous servers,
whose update is exact sync's (``tests/test_parameter_server.py`` checks it by parity); the stale ones run when forced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cost_models.cluster import load_cluster
from planner.api import plan_model_file
from planner.plan import save_plan
from tests.conftest import torchrun

ROOT = Path(__file__).resolve().parent.parent
STEPS = 200
WINDOW = 20
TOLERANCE = 0.10
MODELS = {  # model -> (model file, its args)
    "mlp": (ROOT / "examples" / "mlp.py", {"hidden": 32, "layers": 2}),
    "gpt": (ROOT / "tests" / "counting_lm.py", {"family": "gpt"}),
    "llama": (ROOT / "tests" / "counting_lm.py", {"family": "llama"}),
}
GATHERED = ("terngrad", "qsgd:16", "signsgd")
WORLDS = {  # world -> (cluster shape (nodes, devices per node), method options, lossy choices)
    2: ((2, 1), {"method": "data-parallel"}, ("bf16", "powersgd:4", "local-sgd:4", "local-sgd:16", *GATHERED)),
    4: ((1, 4), {"method": "megatron", "degrees": (2, 1, 2)}, ("bf16", "powersgd:4", *GATHERED)),
}
# every choice on the MLP at world 2, PowerSGD on the sharded stage's buckets at world 4, and a language model, GPT
# on 2 (CI time: the gathered syncs at world 4 were trained by hand on the MLP and Llama; Llama at world 4, bf16 on the
# MLP at world 4 and GPT's gathered syncs and local-sgd:4 ran in CI to 2026-11-28: module docstring; add
# ("llama", 4) here, or empty LEFT_OUT, to train them again)
CASES = [("mlp", 2), ("mlp", 4), ("gpt", 2)]
LEFT_OUT = {("mlp", 4): ("bf16", *GATHERED), ("llama", 4): ("bf16", *GATHERED), ("gpt", 2): ("local-sgd:4", *GATHERED)}


def _choices(model: str, world: int) -> tuple[str, ...]:
    return tuple(c for c in WORLDS[world][2] if c not in LEFT_OUT.get((model, world), ()))


os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[k : k + WINDOW]) / WINDOW for k in range(0, len(losses) - WINDOW + 1, WINDOW)]


@pytest.fixture(scope="module")
def curves(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, list[float]]]:
    found = {}
    for model, world in CASES:
        (nodes, per_node), options, _ = WORLDS[world]
        choices = _choices(model, world)
        file, args = MODELS[model]
        directory = tmp_path_factory.mktemp(f"lossy-{model}-{world}")
        cluster = load_cluster("local-cpu", num_nodes=nodes, devices_per_node=per_node)
        paths = {}
        for choice in ("exact", *choices):
            plan = plan_model_file(
                file, cluster, batch_size=32, model_args=args, allow_lossy=True, grad_sync=choice, **options
            )
            assert plan.grad_sync.label == choice
            paths[choice] = directory / f"{choice.replace(':', '-')}.json"
            save_plan(plan, paths[choice])
        done = torchrun(world, "lossy_worker.py", directory / "losses.json", [str(STEPS), *paths.values()])
        assert done.returncode == 0, done.stderr[-4000:]
        losses = json.loads((directory / "losses.json").read_text())
        found[model, world] = {choice: losses[str(path)] for choice, path in paths.items()}
    return found


@pytest.mark.slow
@pytest.mark.parametrize(("model", "world", "choice"), [(m, w, c) for m, w in CASES for c in _choices(m, w)])
def test_a_lossy_sync_follows_the_exact_loss_curve(curves, model: str, world: int, choice: str) -> None:
    exact, lossy = _windows(curves[model, world]["exact"]), _windows(curves[model, world][choice])
    assert len(exact) == STEPS // WINDOW
    for curve in (exact, lossy):
        assert curve[-1] < 0.5 * curve[0], f"the loss did not go down: {curve}"
    allowed = TOLERANCE * exact[0]
    gaps = [abs(a - b) for a, b in zip(lossy, exact, strict=True)]
    assert max(gaps) <= allowed, f"{choice}: window means {lossy} vs exact {exact} (allowed gap {allowed:.4g})"


@pytest.mark.slow
def test_the_lossy_runs_are_not_the_exact_run(curves) -> None:
    """The hooks really ran: a lossy sync changes the numbers (a test that could not fail otherwise)."""
    for model, world in CASES:
        for choice in _choices(model, world):
            assert curves[model, world][choice] != curves[model, world]["exact"], (model, world, choice)


def test_auto_offers_exactly_the_choices_trained_here() -> None:
    from planner.inter.grad_sync_choice import LOSSY_CHOICES

    tested = {choice for _, _, choices in WORLDS.values() for choice in choices}
    changes_update = {choice.label for choice in LOSSY_CHOICES if not choice.same_update}
    assert changes_update == tested  # the synchronous parameter servers: parity, tests/test_parameter_server.py
