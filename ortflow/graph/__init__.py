"""Rewrites of the user's ONNX graph, applied by configure before the engine sees the model.

Each pass is a pure function ``ModelProto -> ModelProto`` in its own module (export-compatibility fixes, logits
flattening, batch dimensions, mixed-precision casts, pipeline and tensor splits). A pass never changes weight values,
returns a new proto (the input is left as it was), and logs once what it changed. Passes import ``onnx`` and numpy,
and nothing from ortflow outside this package, so each is tested alone on graphs built with ``onnx.helper``.
"""
