"""Rewrites of the user's ONNX graph, applied by configure before the engine sees the model.

Each pass is a pure function ``ModelProto -> ModelProto`` in its own module, grouped by concern:

* :mod:`.exports`: what exporters write that training needs read or rewritten (torch parameter names and layouts, tied
  weights, sequence ops, folded constants, weights in external files, batch dims, logits, GELUs, BatchNorm statistics);
* :mod:`.gradients`: what the engine's gradient builder cannot differentiate, gets wrong or makes slow;
* :mod:`.precision`: mixed precision (the autocast pass, no-op casts, the GPU engine's half-precision kernels);
* :mod:`.tensor_parallel`: the tensor-parallel split (Megatron-style regions, each rank's slices, its pieces);
* :mod:`.pipeline_parallel`: the pipeline cuts into stages, and a stage's forward with BatchNorm in batch mode.

:mod:`.onnx_tools` and :mod:`.shapes` are shared by all of them. A pass never changes weight values,
returns a new proto (the input is left as it was), and logs once what it changed. Passes import ``onnx`` and numpy
(and ONNX Runtime for inference: the batch check runs the model, the shape pass uses its symbolic shape inference),
and nothing from ortflow outside this package, so each is tested alone on graphs built with ``onnx.helper``.
:mod:`ortflow.graph.prepare` holds the one ordered list of preparation passes every graph the engine sees goes
through.
"""
