"""The training program and what it runs on: ``plan compile``'s ``train.py``
(:mod:`~executors.training.program_template`), its runtime (:mod:`~executors.training.runtime`: data feed,
parallel model, precision-aware parity, checkpoints, step log, memory probe) and ``plan run``'s launcher
(:mod:`~executors.training.launch`)."""
