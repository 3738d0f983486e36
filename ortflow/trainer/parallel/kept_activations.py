"""A pipeline stage that runs each micro-batch's forward pass once and keeps its activations until the backward pass.

Without it, a stage that is not the last runs its eval model forward (nothing kept) and later a training call that
recomputes the forward before the backward: two forwards per micro-batch. Here the stage's forward graph (its eval
model: parameters as inputs, the sent tensors as outputs) is turned into the engine's separate forward and backward
calls (:class:`ortflow.engine.ForwardBackward`): the forward keeps the micro-batch's activations in an engine state,
the backward is fed the gradients of the sent tensors and returns the gradients of the received tensors (sent back to
the previous stage) and of the stage's parameters, which are summed here into the training module's gradient buffers,
where the exchange and the update read them as before.

1F1B bounds what is kept: a stage ``s`` of ``P`` holds at most ``P - s`` micro-batches' activations (its warm-up
forwards plus one), and its backwards come in forward order, so the states form a queue.

The sums are bitwise those of the training call: the engine's gradient graph of the forward graph computes each
micro-batch's gradients with the same kernels in the same order as the training model's, and the first micro-batch
after an update is copied, later ones added in float32, as the engine's accumulators do (tests/trainer/
test_kept_activations.py, on a GPT stage; other exports' gradient graphs may round differently from their training
models, docs/engine.md).

A stage or piece whose training model masks an embedding's padding row (torch's ``padding_idx``: configure's
:func:`ortflow.graph.gradients.padding_rows.mask_padding_rows`, with the rank's local row of a vocabulary split) has
the same mask applied to the gradient graph built here, before its session is made (``padding_rows``): its lookup's
gradient takes zero at the padding positions, as the training call's does. A stage or piece whose training model
has its leading-axis sums as MatMuls (configure's :func:`ortflow.graph.gradients.leading_sums.sums_as_matmul`, on
``device: cuda`` with ``distributed.deterministic_compute`` and ``reduce_sum_as_matmul``; its record's
``sums_as_matmul``) has the gradient graph's rewritten the same way, after the mask: the same sums through a MatMul
with a ones vector instead of the engine's deterministic CUDA ``ReduceSum``. The pass reads the graph's shapes from
its declared types and onnx's shape inference, and leaves a sum whose kept dims it cannot read as the engine wrote it.

On a CUDA rank the gradient graph's session runs on a stream the rank owns (the CUDA provider's user compute stream,
:class:`~ortflow.trainer.comm.nccl.EngineStream`): the parameters enter as the engine's own device tensors, the
gradients stay on the GPU and are summed into the training module's device buffers with CuPy on that same stream,
queued behind the backward with no wait between them. Where the sent tensors and the input gradients stay on the GPU (a
stage whose messages go over NCCL, :class:`~ortflow.trainer.comm.device_pipe.DevicePipe`; a tensor-parallel piece, whose
outputs go to the sums on the NCCL stream) the host does not wait for the calls: the NCCL streams wait for the engine
stream's events. Otherwise (a stage whose messages are host arrays) the host waits for the stream once per call, where
what the call wrote leaves it: a forward's outputs and a backward's input gradients with the sums before them.
Measured on an H200 (the 110M GPT, 2 micro-batches of 8 x 256 tokens, host messages): 31.7 ms per update with
deterministic compute, 26.1 ms without, against 25.5 ms for the training call (docs/engine.md).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import numpy as np

from ortflow.engine import ForwardBackward, OrtValue


class KeptActivations:
    """A non-last stage's (or tensor-parallel piece's) forward and backward calls with its in-flight micro-batches'
    activations kept, on the CPU or on the rank's GPU.

    Args:
        eval_model: The stage's eval model (parameters as inputs, the sent tensors as outputs).
        state: The stage's engine ``CheckpointState`` (parameter values and the gradient buffers summed into).
        trainable: The stage's trainable parameters, in the order of its gradient buffers.
        receives: The tensors it receives from the previous stage (their gradients are returned).
        sends: The tensors it sends to the next stage.
        options: Session options of the gradient graph's session.
        recompute: Memory-optimizer plans (``distributed.recompute_subgraphs``).
        buffers: Where the engine keeps the state's buffers (:mod:`ortflow.trainer.comm.engine_buffers`); None or
            host buffers: the CPU engine.
        host_sends: Whether :meth:`forward` and :meth:`backward` return host arrays (a stage whose messages are host
            arrays) or, on a GPU, device tensors (a piece: its tensor-parallel sums and the next pieces read them
            there; a stage whose messages go over NCCL: the pipeline sends them from there).
        padding_rows: Table -> the padding row (in this rank's rows of it) whose lookup gradient its training model
            masks; the gradient graph gets the same mask.
        sums_as_matmul: Whether its training model's leading-axis sums are MatMuls with ones; the gradient graph's
            get the same rewrite.
    """

    def __init__(self, eval_model: Path, state, trainable: list[str], receives: tuple[str, ...],
                 sends: tuple[str, ...], options, recompute: tuple[str, ...] = (), buffers=None,
                 host_sends: bool = True, padding_rows: dict[str, int] | None = None, sums_as_matmul: bool = False):
        import onnx  # here: only pipeline stages read a graph, and a data-parallel rank starts without onnx

        model = onnx.load(str(eval_model))
        self._eval_model = eval_model
        self.padding_rows = dict(padding_rows or {})
        self.masked: list[dict] = []  # the mask's report entries (the lookup gradients it rewrote)
        self.sums_as_matmul = sums_as_matmul
        self.sums = None  # with sums_as_matmul: the LeadingSumReport of the gradient graph (rewritten and kept sums)
        inputs = {i.name for i in model.graph.input}
        parameters = [name for name, _ in state.parameters if name in inputs]
        self._build = (model.SerializeToString(), parameters, list(trainable), list(receives))
        self._recompute = tuple(recompute)
        self._stream = buffers.engine_stream() if buffers is not None else None  # None: the CPU engine
        if self._stream is None:
            self._providers, self._device = ["CPUExecutionProvider"], "cpu"
        else:  # the engine computes on the rank's stream, the sums below are queued behind it
            self._providers = [("CUDAExecutionProvider", self._stream.provider_options()), "CPUExecutionProvider"]
            self._device = f"cuda:{self._stream.device_index}"
        self.host_sends = host_sends or self._stream is None
        #: Received tensor -> an earlier one whose gradient is the same tensor of the gradient graph (its copy, bit for
        #: bit, possibly reshaped: :func:`ortflow.graph.gradients.same_gradients.same_gradients`).
        self.same_input_grads: dict[str, str] = {}
        self.engine = self._engine(options)
        self._plain: ForwardBackward | None = None  # the trainer's calls while a profiling twin runs them
        self.seconds, self.calls = 0.0, 0  # time and calls of the profiled updates
        order = {name: k for k, name in enumerate(self.engine.output_names)}
        missing = [name for name in sends if name not in order]
        if missing:
            raise RuntimeError(f"{eval_model} does not output the sent tensors {missing}: re-run `ortflow configure`")
        self.sends, self.receives = tuple(sends), tuple(receives)
        self._send_order = [order[name] for name in sends]
        if self._stream is None:
            # Parameters enter as engine tensors over the state's own buffers (updated in place: no copy per call).
            self._parameters = {name: self.engine.ortvalue(state.parameters[name].data) for name in parameters}
            self._buffers = [state.parameters[name].grad for name in trainable]
        else:  # the engine's own device tensors (on CUDA ``Parameter.data`` and ``.grad`` are host copies)
            self._parameters = {name: state._state.get_parameter(name).data for name in parameters}
            grads = buffers.gradients(state)
            self._buffers = [grads[name] for name in trainable]
        self._in_flight: deque = deque()
        self._fresh = True  # the next backward copies into the buffers (the first micro-batch after an update)
        self.most_in_flight = 0

    def _engine(self, options) -> ForwardBackward:
        rewrite = self._rewrite if self.padding_rows or self.sums_as_matmul else None
        return ForwardBackward(*self._build, options, self._providers, device=self._device,
                               recompute=self._recompute, rewrite=rewrite, inspect=self._inspect)

    def _inspect(self, model) -> None:
        """Which received tensors' gradients the gradient graph computes as one tensor."""
        from ortflow.graph.gradients.same_gradients import same_gradients

        receives = self._build[3]
        self.same_input_grads = same_gradients(model.graph, {name: f"{name}_grad" for name in receives})

    def _rewrite(self, model):
        """The gradient graph with the passes its training model went through: the padding rows' mask, then the
        leading-axis sums as MatMuls."""
        if self.padding_rows:
            model = self._mask(model)
        if self.sums_as_matmul:
            from ortflow.graph.gradients.leading_sums import LeadingSumReport, sums_as_matmul

            self.sums = LeadingSumReport()
            model = sums_as_matmul(model, details=self.sums)
        return model

    def _mask(self, model):
        """The gradient graph with its padding rows' lookup gradients masked, as the training model's are."""
        from ortflow.graph.gradients.padding_rows import mask_padding_rows

        report: list[dict] = []
        model, unmasked = mask_padding_rows(model, self.padding_rows, report)
        if unmasked or not report:
            found = unmasked or [f"no lookup gradient of {sorted(self.padding_rows)}"]
            raise RuntimeError(f"the gradient graph built from {self._eval_model} has {found} where its training "
                               "model masks torch's padding row: set distributed.recompute_forward: true (the training "
                               "call then runs the forward again and masks it)")
        self.masked = report
        return model

    def _tensor(self, value, kept: list):
        """A feed as the engine's tensor: an engine tensor on this rank's GPU as it is, else a host array (kept in
        ``kept``: on the CPU the engine's tensor is over its memory) through :meth:`ForwardBackward.ortvalue`."""
        if isinstance(value, OrtValue):
            if self._stream is not None and value.device_name().lower() == "cuda":
                return value._ortvalue
            value = value.numpy()
        array = np.ascontiguousarray(value)
        kept.append(array)
        return self.engine.ortvalue(array)

    def forward(self, feeds: dict) -> list:
        """The forward pass of one training micro-batch; returns the sent tensors (in ``sends`` order: host arrays,
        or device tensors of a piece or a stage whose messages go over NCCL) and keeps its activations until
        :meth:`backward`."""
        if self._stream is not None:
            return self._device_forward(feeds)
        arrays = {name: np.ascontiguousarray(feeds[name]) for name in self.engine.feed_names
                  if name not in self._parameters}
        tensors = [self._parameters[name] if name in self._parameters else self.engine.ortvalue(arrays[name])
                   for name in self.engine.feed_names]
        started = time.perf_counter()
        outputs, state = self.engine.forward(tensors)
        self._count(started)
        # The inputs' memory is read by the backward too (the engine's tensors alias it): kept with the state.
        self._in_flight.append((state, tensors, arrays))
        self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
        return [outputs[k] for k in self._send_order]

    def _device_forward(self, feeds: dict) -> list:
        arrays: list = []
        tensors = [self._parameters[name] if name in self._parameters else self._tensor(feeds[name], arrays)
                   for name in self.engine.feed_names]
        stream = self._stream
        stream.after_host_copies()  # the engine reads the batch's copies on its stream
        started = time.perf_counter()
        outputs, state = self.engine.forward(tensors, host=False)
        if self.host_sends:
            stream.synchronize()  # Sync point: the host sends a stage's sent tensors
        # Device sends stay on the stream: a piece's sums and a stage's NCCL sends wait for it on the GPU, and the host
        # waits for it before a training module's call or a host read (activations.DeviceTensors) and at the end of
        # the pipeline step (DevicePipe.wait_sends).
        self._count(started)
        self._in_flight.append((state, tensors, arrays))  # the backward reads the feeds' device memory too
        self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
        if self.host_sends:
            return [np.array(outputs[k].numpy(), copy=True) for k in self._send_order]
        # Not copied: nothing reads a piece's sent tensors after its backward (the next pieces' calls come before),
        # nor a stage's (its backward comes after the next stage received them: that stage sent their gradients).
        return [OrtValue(outputs[k]) for k in self._send_order]

    def backward(self, grads: list) -> list:
        """The backward pass of the oldest micro-batch in flight, fed the gradients of its sent tensors (``sends``
        order); its parameter gradients are summed into the gradient buffers; returns the gradients of the received
        tensors (``receives`` order; host arrays, or device tensors of a piece or a stage whose messages go over
        NCCL)."""
        if not self._in_flight:
            raise RuntimeError("a pipeline stage's backward pass came before any forward pass it could belong to")
        state, _tensors, _arrays = self._in_flight.popleft()
        if self._stream is not None:
            return self._device_backward(state, grads)
        by_output = [None] * len(self.sends)
        for k, grad in zip(self._send_order, grads, strict=True):
            by_output[k] = grad
        started = time.perf_counter()
        results = self.engine.backward(state, by_output)
        self._count(started)
        received = [results[k].numpy() for k in range(len(self.receives))]
        for buffer, grad in zip(self._buffers, results[len(self.receives):], strict=True):
            if self._fresh:
                buffer[...] = grad.numpy()
            else:
                buffer += grad.numpy()
        self._fresh = False
        return received

    def _device_backward(self, state, grads: list) -> list:
        arrays: list = []
        by_output = [None] * len(self.sends)
        for k, grad in zip(self._send_order, grads, strict=True):
            by_output[k] = self._tensor(grad, arrays)
        stream = self._stream
        stream.after_host_copies()  # the engine reads the arriving gradients' copies on its stream
        started = time.perf_counter()
        results = self.engine.backward(state, by_output)
        # Queued behind the backward on the engine's stream: no wait between the two.
        stream.sum_into(self._buffers, results[len(self.receives):], self._fresh)
        self._fresh = False
        if self.host_sends:
            # Sync point: the host sends a stage's input gradients, and the engine may hand the returned tensors'
            # memory to another session once they are dropped.
            stream.synchronize()
        # Device input gradients stay on the stream (a piece's are summed there, a stage's NCCL send waits for it; the
        # other kept sessions run on the same stream, and the host waits for it before any training module's call,
        # after a piece's backward and at the end of a pipeline step).
        self._count(started)
        received = results[: len(self.receives)]
        if self.host_sends:
            return [r.numpy() for r in received]
        return [OrtValue(r) for r in received]

    def profile(self, options) -> None:
        """Run the next calls in a second session of the same gradient graph made with ``options`` (the engine's
        profiler on): the same parameters and gradient buffers, so the same bits; :meth:`unprofile` drops it, which
        writes its trace."""
        self._plain, self.seconds, self.calls = self.engine, 0.0, 0
        self.engine = self._engine(options)

    def unprofile(self) -> None:
        """Back to the trainer's session; the profiling one is dropped (its trace written)."""
        if self._plain is not None:
            self.engine, self._plain = self._plain, None

    def in_flight(self) -> int:
        """Micro-batches whose activations are kept now."""
        return len(self._in_flight)

    def _count(self, started: float) -> None:
        if self._plain is not None:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def reset(self) -> None:
        """After an update: the next micro-batch's gradients replace the buffers' values."""
        if self._in_flight:
            raise RuntimeError(f"{len(self._in_flight)} micro-batch(es) still wait for their backward pass")
        self._fresh = True


def keep_piece_activations(pieces: list, tp_rank: int, last_stage: bool, options, recompute: tuple[str, ...] = (),
                           buffers=None) -> None:
    """Give each tensor-parallel piece that is not the model's last (every piece of a middle pipeline stage) its
    forward-once calls (``piece.kept``); a piece that sends integer tensors keeps recomputing (the engine's backward
    takes a gradient for every output of the forward). A piece whose training model masks an embedding's padding row
    on this rank (``padding_rows[tp_rank]`` of its entry) has its gradient graph masked the same way, and one whose
    training model's leading-axis sums are MatMuls (``sums_as_matmul`` of its entry) has its gradient graph's too.

    Args:
        pieces: The rank's ``PieceRun`` s (``state``, ``folder``, ``info`` with its ``tensor.json`` entry).
        tp_rank: This rank's tensor-parallel rank (the padding rows of a vocabulary split are its own).
        last_stage: Whether they hold the model's loss (the last piece's training call computes it).
        options: Session options of the gradient graphs' sessions.
        recompute: Memory-optimizer plans (``distributed.recompute_subgraphs``).
        buffers: Where the engine keeps the pieces' buffers (None: the CPU engine); on a GPU the pieces' sent
            tensors and input gradients stay there.
    """
    for piece in pieces[: -1 if last_stage else None]:
        info = piece.info
        if list(info["sends"]) != list(info["float_sends"]):
            continue
        trainable = sorted(n for n, p in piece.state.parameters if p.requires_grad)
        rows = info.get("padding_rows")
        piece.kept = KeptActivations(piece.folder / "eval_model.onnx", piece.state, trainable,
                                     tuple(info["float_receives"]), tuple(info["sends"]), options, recompute,
                                     buffers=buffers, host_sends=False, padding_rows=rows[tp_rank] if rows else None,
                                     sums_as_matmul=bool(info.get("sums_as_matmul")))
