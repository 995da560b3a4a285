"""The models that score our decisions, and the disjoint ones we may look at while changing the cost model.

*Scored* (:data:`SCORED`, held out): the cases of ``benchmarks/regret.py`` (does auto pick the plan that runs
fastest?) and of ``benchmarks/memory.py`` (estimated against measured peak memory per rank), each at world 2
and 4 on this machine. None of them is a calibration probe (``calibration/probe_model.py``,
``examples/mlp.py``): :func:`check_scored_disjoint`. Their shapes differ from ``benchmarks/fidelity_sets.py``'s
scored set, which earlier sessions looked at while changing the cost model.

*Development* (:data:`DEVELOPMENT`): the cases a cost-model or memory-model change may be tried and debugged
on. No model file is in both sets (:func:`check_scored_disjoint`), so a change made while looking at the
development cases is scored on models it never saw.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE_MODEL_FILES = ("calibration/probe_model.py", "examples/mlp.py")


@dataclass(frozen=True, kw_only=True)
class ModelCase:
    """A model file (path under ``examples/``), its ``--model-arg``s and the global batch."""

    model: str
    args: Mapping[str, object]
    batch: int

    @property
    def path(self) -> Path:
        return ROOT / "examples" / self.model

    def model_args(self) -> list[str]:
        """``["--model-arg", "k=v", ...]`` for the ``plan`` command."""
        return [item for key, value in self.args.items() for item in ("--model-arg", f"{key}={value}")]


SCORED: dict[str, ModelCase] = {
    "gpt": ModelCase(model="gpt.py", args={"layers": 4, "hidden": 256, "heads": 4, "seq": 128, "vocab": 4096}, batch=8),
    "gpt-deep": ModelCase(
        model="gpt.py", args={"layers": 8, "hidden": 128, "heads": 4, "seq": 64, "vocab": 2048}, batch=16
    ),
    "bert": ModelCase(
        model="zoo/hf_bert.py", args={"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "vocab": 2048}, batch=16
    ),
    "llama": ModelCase(
        model="zoo/hf_llama.py",
        args={"layers": 4, "hidden": 192, "heads": 6, "kv_heads": 2, "seq": 64, "vocab": 2048},
        batch=16,
    ),
    "qwen2": ModelCase(
        model="zoo/hf_qwen2.py",
        args={"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "seq": 64, "vocab": 2048},
        batch=16,
    ),
    "moe": ModelCase(
        model="moe.py", args={"hidden": 128, "experts": 8, "top_k": 2, "layers": 2, "tokens": 64}, batch=16
    ),
    "resnet": ModelCase(model="resnet.py", args={"width": 16, "blocks": 2, "stages": 3, "image_size": 32}, batch=32),
    "lstm": ModelCase(model="zoo/nn_lstm.py", args={"vocab": 2048, "hidden": 192, "layers": 2, "seq": 32}, batch=16),
    "unet": ModelCase(model="zoo/nn_unet.py", args={"width": 16, "depth": 2, "image_size": 32}, batch=16),
    "mixer": ModelCase(
        model="zoo/nn_mlp_mixer.py", args={"image_size": 32, "patch": 4, "hidden": 128, "layers": 4}, batch=32
    ),
    "deit": ModelCase(model="zoo/hf_deit.py", args={"layers": 4, "hidden": 128, "heads": 4, "image": 32}, batch=32),
    "audio-cnn": ModelCase(model="zoo/nn_conv1d_audio.py", args={"mels": 32, "width": 64, "frames": 256}, batch=32),
}

DEVELOPMENT: dict[str, ModelCase] = {
    "mlp": ModelCase(model="mlp.py", args={"hidden": 256, "layers": 4}, batch=64),
    "opt": ModelCase(
        model="zoo/hf_opt.py", args={"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "vocab": 2048}, batch=16
    ),
    "gpt2": ModelCase(
        model="zoo/hf_gpt2.py", args={"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "vocab": 2048}, batch=16
    ),
    "mistral": ModelCase(
        model="zoo/hf_mistral.py",
        args={"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "seq": 64, "vocab": 2048},
        batch=16,
    ),
    "transformer-lm": ModelCase(
        model="zoo/nn_transformer_lm.py", args={"vocab": 2048, "hidden": 128, "heads": 4, "seq": 64}, batch=16
    ),
    "gru": ModelCase(model="zoo/nn_gru.py", args={"vocab": 2048, "hidden": 192, "layers": 2, "seq": 32}, batch=16),
    "batchnorm-cnn": ModelCase(model="zoo/nn_batchnorm_cnn.py", args={"width": 32, "image_size": 32}, batch=32),
    "groupnorm-cnn": ModelCase(model="zoo/nn_groupnorm_cnn.py", args={"width": 32, "image_size": 32}, batch=32),
}


def check_scored_disjoint() -> None:
    """Raise when a scored case runs a calibration probe's model file or a development case's model file."""
    probes = {(ROOT / path).resolve() for path in PROBE_MODEL_FILES}
    development = {case.path.resolve() for case in DEVELOPMENT.values()}
    shared = sorted(name for name, case in SCORED.items() if case.path.resolve() in probes | development)
    if shared:
        raise ValueError(f"scored cases {shared} share a model file with the probes or the development set")
