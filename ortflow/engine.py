"""The one place that imports ``onnxruntime.training`` and owns its import quirks.

* ``import onnxruntime.training`` imports torch through ``training/optim``; registering an empty module under that
  name first keeps torch out (ortflow never needs it: ``api``, ``artifacts`` and ``onnxblock`` do not).
* The GPU build (``onnxruntime-training``) needs CUDA 11.8 and cuDNN 8; they are loaded from pip's ``nvidia-*-cu11``
  packages before the import (:mod:`ortflow.cuda_libs`), so nobody edits LD_LIBRARY_PATH.
* The engine logs every graph transformer at INFO while building artifacts, whatever the default logger's severity:
  the gradient builder makes its own ``SessionOptions``. ortflow hands it options that log warnings and errors only.

Only ``ortflow.trainer`` and ``ortflow.export`` import this module.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types
from types import ModuleType

_OPTIM = "onnxruntime.training.optim"


def _gpu_engine_installed() -> bool:
    try:
        importlib.metadata.distribution("onnxruntime-training")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _import() -> tuple[ModuleType, ModuleType, ModuleType]:
    if _gpu_engine_installed():
        from ortflow import cuda_libs

        # The GPU build links CUDA 11.8 / cuDNN 8 by soname: load them from pip's nvidia-*-cu11 folders first.
        # What is missing is reported when a rank asks for cuda (runtime.select_device) or by `ortflow doctor`.
        cuda_libs.preload(cuda_libs.ENGINE_LIBRARIES, optional=())
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
OrtValue = __import__("onnxruntime").OrtValue  # a tensor where the engine keeps it (a training call's device outputs)


def call_module(module, train: bool, inputs: list, outputs: list) -> list:
    """One training (``train``) or eval call of a training-API ``Module`` on ``OrtValue`` inputs.

    Each output is written into the matching ``OrtValue`` of ``outputs`` where it lies (on the GPU for a device
    tensor); with ``outputs`` empty the engine allocates the outputs itself, on the host (it keeps an output's device
    only for an output the caller allocated). The Python ``Module.__call__`` passes no outputs, hence this call into
    its binding (``train_step_with_ort_values`` / ``eval_step_with_ort_values``). Returns the outputs as OrtValues;
    ``inputs`` and ``outputs`` must stay referenced until it returns.
    """
    binding = __import__("onnxruntime").capi._pybind_state
    feeds, fetches = binding.OrtValueVector(), binding.OrtValueVector()
    feeds.reserve(len(inputs))
    for value in inputs:
        feeds.push_back(value._ortvalue)
    for value in outputs:
        fetches.push_back(value._ortvalue)
    step = module._model.train_step_with_ort_values if train else module._model.eval_step_with_ort_values
    step(feeds, fetches)
    return [OrtValue(value) for value in fetches]
