"""ortflow: data-parallel training of ONNX models with ONNX Runtime's training engine, orchestrated by Prefect."""

__version__ = "0.1.0"
