"""export: checkpoint -> inference ONNX model (verified), and the retention stage that runs before it.

``ortflow.export.export_model`` and ``ortflow.export.retention.retain_checkpoints`` are the stage functions.
Neither makes a training session; the engine is imported only to read checkpoint files.
"""

from ortflow.export.model import ExportResult, export_model
from ortflow.export.verify import ExportError, VerificationError

__all__ = ["ExportError", "ExportResult", "VerificationError", "export_model"]
