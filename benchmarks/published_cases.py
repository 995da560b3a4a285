"""The rows of :mod:`benchmarks.published`: every published run of ``../shared/published-measurements.md``
(the ten Megatron-LM SC'21 rows on DGX A100 and the two Megatron-LM 2019 rows on DGX-2H V100) as a
:class:`Row` — its shape, degrees, batch, cluster, published TFLOP/s per GPU, microbatch size and runtime
profile as SC'21's own script ran it — and the :class:`scale_cases.Case` that plans it as it ran
(:meth:`Row.case`), on the layer the papers ran or on ``examples/gpt.py`` as it is (:data:`VARIANTS`)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.scale_cases import MEGATRON_ROWS, Case

# TFLOP/s per GPU of each SC'21 row, by parameters (B): published-measurements.md, Table 1 of the paper
A100_TFLOPS = {
    1.7: 137,
    3.6: 138,
    7.5: 142,
    18.4: 135,
    39.1: 138,
    76.1: 140,
    145.6: 148,
    310.1: 155,
    529.6: 163,
    1008.0: 163,
}
# Per SC'21 row, by parameters (B): (microbatch size, --DDP-impl, layers per virtual pipeline stage or None), from
# Megatron-LM v2.5 examples/sc21/run_table_1.sh (MBS, DDP, --num-layers-per-virtual-pipeline-stage)
SC21_SCRIPT = {
    1.7: (16, "torch", None),
    3.6: (16, "torch", None),
    7.5: (16, "torch", None),
    18.4: (8, "torch", None),
    39.1: (4, "local", None),
    76.1: (2, "local", 5),
    145.6: (2, "local", 5),
    310.1: (1, "local", 3),
    529.6: (1, "local", 1),
    1008.0: (1, "local", None),
}
RUNTIME_OF_DDP = {"torch": "megatron-lm-2021-torch-ddp", "local": "megatron-lm-2021"}
A100_SEQ, V100_SEQ, VOCAB = 2048, 1024, 51200
V100_BATCH_1GPU = 8  # unstated in the paper for this row: the per-GPU batch of its scaling runs (8 × 64 = 512)
# examples/gpt.py model arguments of each version of the model (see the module docstring)
VARIANTS = {"published": {"attention": "unfused", "dropout": 0.1}, "fused": {}}
AUTO_VARIANT = "fused"  # auto plans examples/gpt.py as it is, under our own runtime


@dataclass(frozen=True, kw_only=True)
class Row:
    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    degrees: tuple[int, int, int]  # (t, p, d)
    gpus: int
    batch: int
    seq: int
    cluster: str
    tflops_per_gpu: float  # published
    source: str
    micro_batch: int  # per data-parallel replica and microbatch (SC'21's script; the 2019 rows: their batch per GPU)
    runtime: str  # planner.costing.runtime_profiles
    virtual_stages: int = 1  # the interleaved schedule's stages per rank it ran (the estimate runs 1F1B)
    note: str = ""

    @property
    def flops_per_iteration(self) -> float:
        """Megatron-LM 2021 Eq. 3 (counts the recomputation's extra forward)."""
        b, s, l, h = self.batch, self.seq, self.layers, self.hidden  # noqa: E741
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))

    @property
    def measured_samples_s(self) -> float:
        return self.tflops_per_gpu * 1e12 * self.gpus / (self.flops_per_iteration / self.batch)

    def case(self, method: str, *, variant: str) -> Case:
        per_node = 16 if self.cluster == "dgx-2h" else 8
        nodes, devices_per_node = (1, self.gpus) if self.gpus < per_node else (self.gpus // per_node, None)
        args = {
            "size": "39b",
            "layers": self.layers,
            "hidden": self.hidden,
            "heads": self.heads,
            "seq": self.seq,
            "vocab": VOCAB,
            **VARIANTS[variant],
        }
        fixed = method == "megatron"
        return Case(
            name=f"{self.name}-{variant}",
            model="examples/gpt.py",
            args=args,
            cluster=self.cluster,
            nodes=nodes,
            batch=self.batch,
            method=method,
            degrees=self.degrees if fixed else None,
            remat="on" if fixed else "auto",
            devices_per_node=devices_per_node,
            space="alpa" if fixed else "full",
            microbatches=self.microbatches if fixed else None,
            runtime=self.runtime if fixed else "autoplan",
        )

    @property
    def microbatches(self) -> int:
        return self.batch // (self.micro_batch * self.degrees[2])


def _megatron_2019_rows() -> list[Row]:
    """The two Megatron-LM 2019 rows on DGX-2H V100 (GPT-2 shapes, seq 1024, one microbatch)."""
    return [
        Row(
            name="gpt-1.2b-v100",
            params_b=1.2,
            heads=16,
            hidden=1536,
            layers=40,
            degrees=(1, 1, 1),
            gpus=1,
            batch=V100_BATCH_1GPU,
            seq=V100_SEQ,
            cluster="dgx-2h",
            tflops_per_gpu=39.0,
            source="Megatron-LM 2019, single-GPU baseline",
            micro_batch=V100_BATCH_1GPU,
            runtime="megatron-lm-2019",
            note=f"batch {V100_BATCH_1GPU} assumed (unstated)",
        ),
        Row(
            name="gpt-8.3b-v100",
            params_b=8.3,
            heads=32,
            hidden=3072,
            layers=72,
            degrees=(8, 1, 64),
            gpus=512,
            batch=512,
            seq=V100_SEQ,
            cluster="dgx-2h",
            tflops_per_gpu=15.1e3 / 512,
            source="Megatron-LM 2019, 15.1 PFLOP/s on 512 GPUs",
            micro_batch=8,
            runtime="megatron-lm-2019",
        ),
    ]


def rows() -> list[Row]:
    """Every published row: the SC'21 rows on DGX A100, then the 2019 rows on DGX-2H V100."""
    found = []
    for params, heads, hidden, layers, t, p, gpus, batch in MEGATRON_ROWS:
        micro_batch, ddp, per_virtual = SC21_SCRIPT[params]
        found.append(
            Row(
                name=f"gpt-{params:g}b",
                params_b=params,
                heads=heads,
                hidden=hidden,
                layers=layers,
                degrees=(t, p, gpus // (t * p)),
                gpus=gpus,
                batch=batch,
                seq=A100_SEQ,
                cluster="dgx-a100",
                tflops_per_gpu=A100_TFLOPS[params],
                source="Megatron-LM SC'21, Table 1",
                micro_batch=micro_batch,
                runtime=RUNTIME_OF_DDP[ddp],
                virtual_stages=layers // p // per_virtual if per_virtual else 1,
            )
        )
    return [*found, *_megatron_2019_rows()]
