"""How a plan's stages run in parallel on this rank.

* :mod:`~executors.parallel.tensor_parallel` — every node's stored sharding on DTensor (1-D or 2-D meshes);
* :mod:`~executors.parallel.stages` — one plan stage on this rank: its segment, mesh, DTensor parameters;
* :mod:`~executors.parallel.grad_sync` — a sharded stage's gradient reduction in buckets;
* :mod:`~executors.parallel.data_parallel` — one replicated stage as DDP or FSDP;
* :mod:`~executors.parallel.pipeline`, :mod:`~executors.parallel.uneven_pipeline` — pipeline stages under
  ``torch.distributed.pipelining``, and stages of different device counts;
* :mod:`~executors.parallel.placement` — op placements: point-to-point sends between per-node graphs.
"""
