"""The model as a graph: model files, capture to an :class:`~planner.ir.graph.OpGraph`, layers.

* :mod:`~planner.ir.model_file` — load a model file (``build_model``, ``example_inputs``, ``loss_fn``);
* :mod:`~planner.ir.capture` — ``torch.export`` / ``torch.fx`` to an OpGraph, shapes and FLOPs on meta tensors;
* :mod:`~planner.ir.repeated_layers` — a stack of identical layers exported at a few layers, written out at all;
* :mod:`~planner.ir.graph` — ``OpGraph``, ``OpNode``, ``TensorMeta``, value kinds, subgraphs;
* :mod:`~planner.ir.node_call` — re-calling a node on meta, fake or real tensors;
* :mod:`~planner.ir.op_kinds` — which kind of operator a node is;
* :mod:`~planner.ir.layers` — layers from repeated blocks (or Alpa's clustering DP), identical layers;
* :mod:`~planner.ir.rebatch` — the graph at other microbatch sizes without capturing again.

May import: :mod:`planner.errors`, torch, numpy. Everything else imports the IR; :mod:`cost_models`
and :mod:`executors` read it too.
"""
