"""The one place that imports ``onnxruntime.training`` and owns its import quirks.

* ``import onnxruntime.training`` imports torch through ``training/optim``; registering an empty module under that
  name first keeps torch out (ortflow never needs it: ``api``, ``artifacts`` and ``onnxblock`` do not).
* The engine logs every graph transformer at INFO while building artifacts, whatever the default logger's severity:
  the gradient builder makes its own ``SessionOptions``. ortflow hands it options that log warnings and errors only.

Only ``ortflow.trainer`` and ``ortflow.export`` import this module.
"""

from __future__ import annotations

import sys
import types
from types import ModuleType

_OPTIM = "onnxruntime.training.optim"


def _import() -> tuple[ModuleType, ModuleType, ModuleType]:
    if _OPTIM not in sys.modules:
        stub = types.ModuleType(_OPTIM)
        stub.__doc__ = "Placeholder registered by ortflow.engine so that onnxruntime.training does not import torch."
        sys.modules[_OPTIM] = stub
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    from onnxruntime.training import api, artifacts, onnxblock
    from onnxruntime.training.onnxblock import _training_graph_utils

    def quiet_options() -> onnxruntime.SessionOptions:
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        return options

    _training_graph_utils.SessionOptions = quiet_options
    return api, artifacts, onnxblock


api, artifacts, onnxblock = _import()

ORT_VERSION: str = __import__("onnxruntime").__version__
