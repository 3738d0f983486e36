"""Rewrites of the user's ONNX graph, applied by configure before the engine sees the model.

Each pass is a pure function ``ModelProto -> ModelProto`` in its own module (export-compatibility fixes, logits
flattening, batch dimensions, mixed-precision casts, pipeline and tensor splits). A pass never changes weight values,
returns a new proto (the input is left as it was), and logs once what it changed. Passes import ``onnx`` and numpy
(and ONNX Runtime for inference: the batch check runs the model, the shape pass uses its symbolic shape inference),
and nothing from ortflow outside this package, so each is tested alone on graphs built with ``onnx.helper``.
:mod:`ortflow.graph.prepare` holds the one ordered list of preparation passes every graph the engine sees goes
through.
"""
