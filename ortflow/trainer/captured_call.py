"""A CUDA rank's training call replayed from a CUDA graph (``distributed.cuda_graphs``).

The training API's call launches each kernel of the training graph from the host; on a GPU that is fast enough to
finish a kernel before the next is launched, the step is bound by those launches. The CUDA provider can record the
launches of a session's run once and replay them (``enable_cuda_graph``), for sessions whose inputs and outputs stay
at fixed device addresses: this module runs configure's cut of the training graph (:mod:`ortflow.graph.capture`:
the recorded head, and the tail of nodes that cannot be recorded) as two sessions bound once to

* the engine's own parameter and gradient buffers (the training API's ``Module`` keeps them; the exchange, the update
  and the checkpoints work on those same buffers, so nothing else changes),
* device tensors for the batch and the loss scale, written in place before each call,
* device tensors for the loss and for what the tail reads from the head.

The gradient-accumulation flag is read by the host when a kernel is launched, so it is recorded with the graph: two
graphs are recorded (one that overwrites the gradients, the first micro-batch of an update, and one that adds to
them), chosen per call by the provider's ``gpu_graph_id`` run option. The first call of each kind runs and records;
the call before the first recording runs without (it finds the shapes of the tensors the tail reads).

The engine's recording call runs the graph more than once (plain runs, the recording, a replay): the gradient
buffers are saved before it and restored after, then one replay computes the call. Where the engine cannot record a
model's call (it places some nodes on the host and copies between host and device inside the call, or a kernel waits
for the device while recording), the rank restores the buffers the failed recording may have written, says so once
and launches every kernel of the same cut (the head's plain session) from then on.

A run through the cut ends with the training API call's parameters bitwise (tests/gpu/test_gpu_cuda_graphs.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime
from onnxruntime import OrtValue

log = logging.getLogger("ortflow.trainer")

#: The engine's gradient buffer of a parameter, and the flag that makes a call overwrite them (the training API's).
_BUFFER_SUFFIX = "_grad.accumulation.buffer"
_RESET = "lazy_reset_grad"
#: ``gpu_graph_id`` of the graph that overwrites the gradients and of the one that adds to them.
_GRAPH_IDS = {True: "1", False: "2"}
_ELEM_TYPES = {"tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(int32)": 6, "tensor(int64)": 7,
               "tensor(bool)": 9, "tensor(float16)": 10, "tensor(double)": 11, "tensor(bfloat16)": 16}


class CapturedTraining:
    """The training calls of one engine module as CUDA graph replays.

    Args:
        head: The recorded part (configure's ``training_head.onnx``).
        tail: The part run after it, or None.
        state: The module's checkpoint state (its parameter and gradient buffers are bound, not copied).
        device: The CUDA device index.
        options: The module's session options.
    """

    def __init__(self, head: Path, tail: Path | None, state, device: int, options: onnxruntime.SessionOptions):
        self.head_path, self.tail_path, self.state, self.device, self.options = head, tail, state, device, options
        self._shapes: dict[str, tuple] | None = None  # the batch shapes it was built for
        self._values: dict[str, OrtValue] = {}
        self._head = self._tail = self._plain = None  # (session, its IOBinding) each
        self._recorded: set[str] = set()  # the gpu_graph_ids recorded so far
        self._accumulated: dict[str, OrtValue] = {}  # the gradient buffers the head adds to

    def takes(self, feeds: dict[str, np.ndarray]) -> bool:
        """Whether a call with ``feeds`` can replay: before the first call, or with the first call's shapes."""
        return self._shapes is None or all(np.shape(feeds[n]) == s for n, s in self._shapes.items())

    def __call__(self, feeds: dict[str, np.ndarray], reset: bool) -> float:
        """One training call: the gradients of ``feeds`` written into (``reset``) or added to the engine's
        gradient buffers; returns the loss."""
        if self._shapes is None:
            return self._first_call(feeds, reset)
        for name in self._shapes:
            self._values[name].update_inplace(np.ascontiguousarray(feeds[name]))
        self._values[_RESET].update_inplace(np.array([reset]))
        if self._head is not None:
            self._replay(_GRAPH_IDS[reset])
        if self._head is None:
            self._plain[0].run_with_iobinding(self._plain[1])
        if self._tail is not None:
            self._tail[0].run_with_iobinding(self._tail[1])
        return float(self._loss.numpy().reshape(-1)[0])

    def _replay(self, graph_id: str) -> None:
        """Replay the recorded head; the first call of a graph records it.

        The engine's recording call runs the graph more than once (plain runs that size its memory, the recording,
        then a replay to compute what the recording did not), so a graph that adds to the gradients would add this
        call's twice: the gradient buffers are saved before it and restored after, and one replay computes the call.
        A recording that fails (a kernel that waits for the device) may have run the graph too: the buffers are
        restored and every kernel is launched from then on."""
        session, io = self._head
        run_options = onnxruntime.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", graph_id)
        if graph_id in self._recorded:
            session.run_with_iobinding(io, run_options)
            return
        saved = {name: value.numpy() for name, value in self._accumulated.items()}
        try:
            session.run_with_iobinding(io, run_options)
        except RuntimeError as err:
            self._give_up(err)
        for name, value in self._accumulated.items():
            value.update_inplace(saved[name])
        if self._head is not None:
            session.run_with_iobinding(io, run_options)
            self._recorded.add(graph_id)

    @property
    def replays(self) -> bool:
        """Whether its calls replay a CUDA graph (False after the engine could not record one)."""
        return self._head is not None

    def _give_up(self, err: Exception) -> None:
        """Launch every kernel from now on (the head's plain session), saying why once."""
        self._head = None
        reason = str(err).strip().splitlines()[0][-300:]
        log.warning("training calls launch every kernel: the engine could not record this model's training call as a "
                    "CUDA graph (%s); distributed.cuda_graphs false skips the attempt", reason)  # fmt: skip

    # -- building ------------------------------------------------------------------------------------------------

    def _engine_value(self, name: str) -> OrtValue | None:
        """A parameter's or a gradient buffer's device tensor in the engine's state (no copy), else None."""
        names = {n for n, _ in self.state.parameters}
        if name in names:
            return OrtValue(self.state._state.get_parameter(name).data)
        if name.endswith(_BUFFER_SUFFIX) and name.removesuffix(_BUFFER_SUFFIX) in names:
            return OrtValue(self.state._state.get_parameter(name.removesuffix(_BUFFER_SUFFIX)).grad)
        return None

    def _bind_inputs(self, session, io, feeds: dict[str, np.ndarray]) -> None:
        for arg in session.get_inputs():
            value = self._values.get(arg.name)
            value = self._engine_value(arg.name) if value is None else value
            if value is None:
                if arg.name == _RESET:  # read by the host at launch
                    value = OrtValue.ortvalue_from_numpy(np.array([True]))
                elif arg.name in feeds:
                    value = OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[arg.name]), "cuda", self.device)
                else:
                    raise RuntimeError(f"{self.head_path.parent}: the captured training graph reads '{arg.name}', "
                                       "which is neither a parameter, a gradient buffer nor a batch input: re-run "
                                       "`ortflow configure`")  # fmt: skip
                self._values[arg.name] = value
            io.bind_ortvalue_input(arg.name, value)

    def _first_call(self, feeds: dict[str, np.ndarray], reset: bool) -> float:
        """Run the head once without recording (the tail's inputs get their shapes), then build the recorded head
        and the tail, and run the tail: the first training call."""
        providers = [("CUDAExecutionProvider", {"device_id": self.device})]
        plain = onnxruntime.InferenceSession(str(self.head_path), self.options, providers=providers)
        io = plain.io_binding()
        self._bind_inputs(plain, io, feeds)
        self._values[_RESET].update_inplace(np.array([reset]))
        for arg in plain.get_outputs():
            io.bind_output(arg.name, "cuda", self.device)
        plain.run_with_iobinding(io)
        outputs = dict(zip([a.name for a in plain.get_outputs()], io.get_outputs(), strict=True))
        types = {a.name: a.type for a in plain.get_outputs()}
        self._shapes = {n: np.shape(feeds[n]) for n in feeds if n in self._values and n != _RESET}
        self._values.update(outputs)  # fixed device tensors for every head output
        self._loss = outputs[plain.get_outputs()[0].name]
        for name, value in outputs.items():  # the plain session writes there from now on too
            io.bind_ortvalue_output(name, value)
        self._plain = (plain, io)
        if self.tail_path is not None:
            self._tail = self._tail_session(types)
            self._tail[0].run_with_iobinding(self._tail[1])
        try:
            recorded = onnxruntime.InferenceSession(
                str(self.head_path), self.options,
                providers=[("CUDAExecutionProvider", {"device_id": self.device, "enable_cuda_graph": "1"})])
        except Exception as err:  # noqa: BLE001 - the engine refuses capture for nodes it runs on the host
            self._give_up(err)
            return float(self._loss.numpy().reshape(-1)[0])
        io = recorded.io_binding()
        self._bind_inputs(recorded, io, feeds)
        self._accumulated = {a.name: self._engine_value(a.name) for a in recorded.get_inputs()
                             if a.name.endswith(_BUFFER_SUFFIX)}
        for arg in recorded.get_outputs():
            io.bind_ortvalue_output(arg.name, self._values[arg.name])
        self._head = (recorded, io)
        log.info("training calls replay a CUDA graph (distributed.cuda_graphs)%s",
                 f"; {self.tail_path.name} runs after each replay" if self._tail is not None else "")
        return float(self._loss.numpy().reshape(-1)[0])

    def _tail_session(self, types: dict[str, str]):
        """The tail, its inputs from the head typed as the head's session reports them, bound once."""
        import onnx  # a CUDA rank with a tail only

        model = onnx.load(str(self.tail_path))
        for arg in model.graph.input:
            if not arg.type.tensor_type.elem_type and arg.name in types:
                arg.type.tensor_type.elem_type = _ELEM_TYPES[types[arg.name]]
        session = onnxruntime.InferenceSession(model.SerializeToString(), self.options,
                                               providers=[("CUDAExecutionProvider", {"device_id": self.device})])
        io = session.io_binding()
        for arg in session.get_inputs():
            value = self._values.get(arg.name)
            value = self._engine_value(arg.name) if value is None else value
            if value is None:
                raise RuntimeError(f"{self.tail_path}: reads '{arg.name}', which the head does not compute: re-run "
                                   "`ortflow configure`")  # fmt: skip
            self._values.setdefault(arg.name, value)
            io.bind_ortvalue_input(arg.name, value)
        for arg in session.get_outputs():
            io.bind_output(arg.name, "cuda", self.device)
        return session, io
