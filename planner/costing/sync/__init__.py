"""The gradient syncs' own prices, beside :mod:`planner.costing.compression` (which dispatches to them):

* :mod:`~planner.costing.sync.wire_bytes` — the bytes one rank sends per gradient under a gathered sync (the
  executor's payloads are tested equal to it);
* :mod:`~planner.costing.sync.gathered` — the gathered syncs (top-k, 1-bit, threshold, TernGrad, QSGD, signSGD,
  DGC): an all-gather of the payloads, encode and decode at the device's streaming bandwidth;
* :mod:`~planner.costing.sync.delayed` — Delayed Gradient Averaging: the exact all-reduce, hidden behind ``D`` steps.
"""
