"""Seconds and bytes: clusters, devices, compute, communication, memory, the simulator; no planning decision.

A layer of the planner's stack, not a package beside it: it prices the IR (:mod:`planner.ir`'s ``OpGraph``,
``OpNode``, ``TensorMeta``) and raises the user's error type (:mod:`planner.errors`), so it imports those two and
:mod:`planner.atomic_file`, and every planner room that prices (:mod:`planner.sharding`, :mod:`planner.plan`,
:mod:`planner.costing` and up) imports it. Never :mod:`executors` or :mod:`calibration` (import-linter contracts
in ``pyproject.toml``).
"""
