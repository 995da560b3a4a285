"""autoplan's executors: a plan run on this rank; the only package with process groups.

* :mod:`~executors.session` — the process group, the model rebuilt and captured, the fingerprint checked;
* :mod:`~executors.runner` — the runner a plan's shape calls for (:func:`~executors.runner.make_runner`);
* :mod:`~executors.graph_module` — part of a captured graph run as an ``nn.Module``;
* :mod:`~executors.precision`, :mod:`~executors.parity`, :mod:`~executors.semantics` — what a run trains with,
  and ``--check-parity`` against one process;
* :mod:`executors.parallel` — how a plan's stages run in parallel: tensor parallel (DTensor), data parallel
  (DDP, FSDP), pipelines, op placements, gradient sync;
* :mod:`executors.training` — the generated ``train.py``, its runtime and ``plan run``'s launcher;
* :mod:`executors.measure` — plans timed and their peak memory measured as they run.

May import: :mod:`planner.plan`, :mod:`planner.ir`, :mod:`planner.costing`, :mod:`planner.errors`,
:mod:`planner.atomic_file`, :mod:`cost_models`; never the search, highspy or pulp.
"""
