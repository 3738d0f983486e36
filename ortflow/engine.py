"""The one place that imports ``onnxruntime.training`` and owns its import quirks.

* ``import onnxruntime.training`` imports torch through ``training/optim``; registering an empty module under that
  name first keeps torch out (ortflow never needs it: ``api``, ``artifacts`` and ``onnxblock`` do not).
* The GPU build (``onnxruntime-training``) needs CUDA 11.8 and cuDNN 8; they are loaded from pip's ``nvidia-*-cu11``
  packages before the import (:mod:`ortflow.cuda_libs`), so nobody edits LD_LIBRARY_PATH.
* The engine logs every graph transformer at INFO while building artifacts, whatever the default logger's severity:
  the gradient builder makes its own ``SessionOptions``. ortflow hands it options that log warnings and errors only.
* ``import onnxruntime`` imports the whole training package (its build check tries ``ortmodule``), and that imports
  ``artifacts``, which imports onnx and the ORT-format tools: a third of a second of CPU that a rank, which only runs
  ``api``, never needs. A placeholder stands for ``artifacts`` until a name of it is used (the real module then
  runs), and this module's ``artifacts`` and ``onnxblock`` are imported when first asked for (configure and export
  build graphs with them). So that this applies, ranks import this module before ``onnxruntime``.
* The ORT-format tools call ``logging.basicConfig`` when imported, which would give the root logger a stderr handler
  in every process that builds a graph (its records then print twice, and ``ortflow run``'s terminal finds Prefect's
  console handler behind it): the root logger keeps the handlers it had.

Only ``ortflow.trainer`` and ``ortflow.export`` import this module.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
import types
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

_OPTIM = "onnxruntime.training.optim"
_ARTIFACTS = "onnxruntime.training.artifacts"


def _gpu_engine_installed() -> bool:
    try:
        importlib.metadata.distribution("onnxruntime-training")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class _OnFirstUse(ModuleType):
    """Stands in ``sys.modules`` for a module that runs when a name of it is first used (not when it is imported)."""

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):  # the import system's probes (__path__, __file__) find a plain, empty module
            raise AttributeError(attr)
        return getattr(_run(self.__name__), attr)


def _run(name: str) -> ModuleType:
    """Module ``name``, run now in place of its :class:`_OnFirstUse` placeholder if it has one (the root logger's
    handlers as they were)."""
    if isinstance(sys.modules.get(name), _OnFirstUse):
        del sys.modules[name]
    root = logging.getLogger()
    kept = list(root.handlers)
    try:
        return importlib.import_module(name)
    finally:
        for handler in [h for h in root.handlers if h not in kept]:
            root.removeHandler(handler)


def _import() -> ModuleType:
    if _gpu_engine_installed():
        from ortflow import cuda_libs

        # The GPU build links CUDA 11.8 / cuDNN 8 by soname: load them from pip's nvidia-*-cu11 folders first.
        # What is missing is reported when a rank asks for cuda (runtime.select_device) or by `ortflow doctor`.
        cuda_libs.preload(cuda_libs.ENGINE_LIBRARIES, optional=())
    if _OPTIM not in sys.modules:
        stub = types.ModuleType(_OPTIM)
        stub.__doc__ = "Placeholder registered by ortflow.engine so that onnxruntime.training does not import torch."
        sys.modules[_OPTIM] = stub
    if "onnxruntime" not in sys.modules:
        sys.modules.setdefault(_ARTIFACTS, _OnFirstUse(_ARTIFACTS))
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    from onnxruntime.training import api

    return api


def _quiet_options():
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return options


api = _import()

if TYPE_CHECKING:  # what __getattr__ below provides
    from onnxruntime.training import artifacts, onnxblock  # noqa: F401


def __getattr__(name: str) -> ModuleType:
    # ``artifacts`` and ``onnxblock`` (graph building: configure, export) are imported when first asked for: they
    # import onnx, which a rank does not need.
    if name not in ("artifacts", "onnxblock"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    artifacts = _run(_ARTIFACTS)
    from onnxruntime.training import onnxblock
    from onnxruntime.training.onnxblock import _training_graph_utils

    _training_graph_utils.SessionOptions = _quiet_options
    globals().update(artifacts=artifacts, onnxblock=onnxblock)
    return globals()[name]


ORT_VERSION: str = __import__("onnxruntime").__version__
OrtValue = __import__("onnxruntime").OrtValue  # a tensor where the engine keeps it (a training call's device outputs)
set_seed = __import__("onnxruntime").set_seed  # the engine's random seed (dropout and other random ops in graphs)


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


class ForwardBackward:
    """Separate forward and backward engine calls of one forward graph (the engine's ``TrainingAgent``, the machinery
    under ORTModule, used without torch).

    The gradient graph is built from a forward graph whose parameters are graph inputs (an eval model of the training
    artifacts is one); :meth:`forward` runs the forward pass of one micro-batch and keeps its activations in the
    returned state; :meth:`backward`, fed with the gradients of the forward's outputs, returns the gradients of the
    requested inputs and of the trainable parameters, in the order asked for, and frees the state's activations. Several
    micro-batches may be in flight, each with its own state; their backwards may run in any order.

    Args:
        model: The forward graph (serialised ``ModelProto``).
        parameters: Graph inputs that hold parameters (trainable and frozen).
        trainable: The parameters whose gradients :meth:`backward` returns.
        input_grads: Graph inputs (not parameters) whose gradients :meth:`backward` returns first.
        options: The session options of the gradient graph's session.
        providers: Its execution providers (names, or ``(name, options)`` pairs: a CUDA rank's
            ``user_compute_stream``).
        device: Where the outputs and gradients land: ``cpu`` or ``cuda:N`` (then the parameters are fed as the
            engine's own device tensors and the gradients stay on the GPU).
        recompute: Memory-optimizer plans (``SUBGRAPH:1:COUNT``): those subgraphs' outputs are recomputed in the
            backward instead of kept. The engine finds them in this gradient graph (its forward/backward boundary is
            marked as ORTModule's is), not in the training API's training model.
        rewrite: A pass over the engine's gradient graph (``ModelProto -> ModelProto``) run before its session is
            made; it keeps the graph's inputs and outputs (a padding row's masked lookup gradient).
        inspect: Called with the gradient graph the session runs (after ``rewrite``), to read it.
    """

    def __init__(self, model: bytes, parameters: list[str], trainable: list[str], input_grads: list[str], options,
                 providers: list, device: str = "cpu", recompute: tuple[str, ...] = (), rewrite=None, inspect=None):
        import onnx  # graph inspection only
        import onnxruntime

        binding = onnxruntime.capi._pybind_state
        config = binding.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = list(parameters)
        config.initializer_names_to_train = list(trainable)
        config.input_names_require_grad = list(input_grads)
        config.build_gradient_graph = True
        builder = binding.OrtModuleGraphBuilder()
        builder.initialize(model, config)
        builder.build(binding.TrainingGraphTransformerConfiguration())
        gradient_model = builder.get_gradient_model()
        proto = onnx.load_model_from_string(gradient_model)
        if rewrite is not None:
            proto = rewrite(proto)
            gradient_model = proto.SerializeToString()
        graph = proto.graph
        self.feed_names = [i.name for i in graph.input]
        self.output_names = list(builder.get_graph_info().user_output_names)
        built = [o.name for o in graph.output]  # the input gradients in graph input order, then the parameters'
        self.grad_names = [f"{n}_grad" for n in (*input_grads, *trainable)]
        if sorted(built) != sorted(self.grad_names):
            raise RuntimeError(f"the engine's gradient graph returns {built}, not {self.grad_names}")
        self._order = [built.index(n) for n in self.grad_names]
        if inspect is not None:
            inspect(proto)
        self._binding = binding
        self._session = _session(gradient_model, options, providers, recompute)
        kind, _, index = device.partition(":")
        where = binding.OrtDevice.cuda() if kind == "cuda" else binding.OrtDevice.cpu()
        self._device = binding.OrtDevice(where, binding.OrtDevice.default_memory(), int(index or 0))
        devices = [self._device] * len(self.output_names), [self._device] * len(built)
        self._agent = binding.TrainingAgent(self._session._sess, self.feed_names, devices[0], built, devices[1], 0)

    def _vector(self, values: list):
        vector = self._binding.OrtValueVector()
        vector.reserve(len(values))
        for value in values:
            vector.push_back(value._ortvalue if isinstance(value, OrtValue) else value)
        return vector

    def ortvalue(self, array):
        """A host array as the engine's tensor: over the same memory on the CPU (the array must outlive every call
        reading it), a copy on the GPU."""
        return self._binding.OrtValue.ortvalue_from_numpy(array, self._device)

    def forward(self, feeds: list, host: bool = True) -> tuple[list, object]:
        """The forward pass on ``feeds`` (engine tensors from :meth:`ortvalue`, in ``feed_names`` order); returns the
        outputs (host arrays; with ``host`` False the engine's own tensors where they lie, which the caller reads
        only once the call's work is done and not after :meth:`backward`) and the state that holds its activations
        until :meth:`backward`."""
        state = self._binding.PartialGraphExecutionState()
        outputs = self._binding.OrtValueVector()
        self._agent.run_forward(self._vector(feeds), outputs, state, None)
        if not host:
            return [outputs[i] for i in range(len(outputs))], state
        # Copied: a forward output's buffer can be one the backward pass writes into (the loss, measured).
        return [np.array(outputs[i].numpy(), copy=True) for i in range(len(outputs))], state

    def backward(self, state, output_grads: list) -> list:
        """The backward pass of the forward that made ``state``, fed with the gradients of its outputs (host arrays or
        engine tensors, in ``output_names`` order); the gradients in ``grad_names`` order (engine tensors)."""
        arrays = [g if isinstance(g, (OrtValue, self._binding.OrtValue)) else np.ascontiguousarray(g)
                  for g in output_grads]  # referenced until the call returns: the tensors read their memory
        feeds = [a if isinstance(a, (OrtValue, self._binding.OrtValue)) else self.ortvalue(a) for a in arrays]
        grads = self._binding.OrtValueVector()
        self._agent.run_backward(self._vector(feeds), grads, state)
        return [grads[i] for i in self._order]


def _session(model: bytes, options, providers: list, recompute: tuple[str, ...]):
    """An inference session of ``model``; with ``recompute``, the memory optimizer's plans (it reads them from a JSON
    file while the session is made)."""
    import json
    import os
    import tempfile

    import onnxruntime

    # A partial run plans each state's memory on its own; with memory patterns every forward in flight takes a block
    # of the whole graph's plan: on an H200, gpt_1024 (110M parameters, 2 micro-batches) grew the GPU memory by
    # 16.0 GiB with patterns and 3.0 GiB without (the training call: 2.5 GiB), and took 46.5 instead of 66.1 ms per
    # update. (It changes the caller's ``options``.)
    options.enable_mem_pattern = False
    if not recompute:
        return onnxruntime.InferenceSession(model, options, providers)
    handle, path = tempfile.mkstemp(suffix=".json", prefix="ortflow-recompute-")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(list(recompute), f)
        options.add_session_config_entry("optimization.memory_optimizer_config", path)
        options.add_session_config_entry("optimization.enable_memory_probe_recompute_config", "1:0")
        return onnxruntime.InferenceSession(model, options, providers)
    finally:
        os.unlink(path)
