"""export: checkpoint -> inference ONNX model (verified), and the evaluation of a checkpoint.

``ortflow.export.export_model`` is the stage function (the retention stage before it is
:func:`ortflow.checkpoints.retention.retain_checkpoints`).
Neither makes a training session; the engine is imported only to read checkpoint files.
"""

from ortflow.export.model import ExportResult, export_model
from ortflow.export.verify import ExportError, VerificationError

__all__ = ["ExportError", "ExportResult", "VerificationError", "export_model"]
