"""The preparation pipeline: one ordered list of passes (:data:`PASSES`) that every graph the engine sees goes through.

The whole model, each pipeline stage, each tensor-parallel piece and each pipeline x tensor-parallel piece are handed to
the engine only through :func:`prepare_model`, which runs :data:`PASSES` in order and records their names in
``PreparedModel.passes`` (configure writes them into its record for every graph, and a test compares them). A split
model is first prepared whole (without the loss) and cut afterwards, then every cut graph is prepared again: passes
are idempotent, so the second run changes only what depends on the graph (its parameters, its loss, its outputs).

Order matters: unused-parameter detection first, then optional outputs, the exporter's sequence ops and Split rewrites
(they make more nodes differentiable), then shapes read from the inputs (shape arithmetic then depends on no parameter,
so a cut never has to carry it), then ONNX's tanh Gelu as the engine's FastGelu (for its gradient) and (when asked) the
GELU fusion (on CPU ranks with the tanh GELU in its sigmoid form, whose CPU gradient is fast), then the gradient fixes,
then repeated inputs, then the declared shapes of broadcast operands (so the engine's gradient of a broadcasting op sums
over the broadcast axes), then (when asked) the embedding reads with a repeatable CPU gradient, then the logits
flattening for the loss (only on the graph that computes the loss), and last the check that every node on the trained
path has a gradient (on the graph the engine will see). No step changes an initializer.

The passes run on a skeleton of the model whose weights hold no values (name, type and dims only); the original tensors
are put back at the end. Constants stay whole wherever an exporter puts them: ``Constant`` nodes (TorchScript) and small
initializers (the dynamo exporter keeps scalars, shapes and axes as initializers of at most :data:`CONSTANT_ELEMENTS`
values), so every pass reads them; a pass that reads a weight gets None from
:func:`ortflow.graph.onnx_tools.constant_values`, never an empty array. So weights never go through a pass, and a 400 MB
model is not copied once per pass (measured on the 97.8M-parameter GPT, ``build_gpt(vocab_size=8192, seq_len=256,
d_model=768, num_layers=12, num_heads=12)``, 2 shared cores: 28.8 s when the passes copied the values, 2.8 s on the
skeleton).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from ortflow.graph.exports.gelu import gelu_rewrites
from ortflow.graph.exports.logits import flatten_logits
from ortflow.graph.exports.sequences import sequences_to_tensors
from ortflow.graph.exports.untrainable import untrainable_initializers
from ortflow.graph.gradients.differentiable import check_differentiable
from ortflow.graph.gradients.embedding import deterministic_gathers
from ortflow.graph.gradients.gradient_fixes import gradient_fixes
from ortflow.graph.gradients.optional_outputs import declare_optional_outputs
from ortflow.graph.gradients.repeated import separate_repeated_inputs
from ortflow.graph.gradients.split import split_to_slices
from ortflow.graph.onnx_tools import FLOAT_TYPES, elem_types
from ortflow.graph.shapes import declare_broadcast_shapes, shapes_from_inputs

#: The preparation passes, in the order :func:`prepare_model` runs them on every graph the engine sees.
PASSES = (
    "untrainable_initializers",
    "declare_optional_outputs",
    "sequences_to_tensors",
    "split_to_slices",
    "shapes_from_inputs",
    "gelu_rewrites",
    "gradient_fixes",
    "separate_repeated_inputs",
    "declare_broadcast_shapes",
    "deterministic_gathers",
    "flatten_logits",
    "check_differentiable",
)


@dataclass(frozen=True)
class PreparedModel:
    """What :func:`prepare_model` returns.

    Attributes:
        model: The model the engine gets.
        loss_input: The tensor the loss reads (the configured output, or its flattened form).
        label_input: The label tensor the loss reads (the label input, or its flattened form); None for model_output.
        frozen: Initializers the engine must not train whatever the config says (running statistics, constants
            that feed only inputs the engine does not differentiate, unused ones).
        report: One ``{"pass", "changes"}`` entry per pass that changed something (for configure.json).
        passes: The passes that ran, in order (:data:`PASSES` for every graph prepared here).
    """

    model: onnx.ModelProto
    loss_input: str | None
    label_input: str | None
    frozen: tuple[str, ...] = ()
    report: list[dict] = field(default_factory=list)
    passes: tuple[str, ...] = ()


def prepare_model(
    model: onnx.ModelProto,
    trainable: set[str],
    loss: str,
    loss_output: str | None,
    label_input: str | None,
    repeatable_gathers: bool = False,
    fuse_gelu: bool | str = False,
    keep: set[str] | None = None,
) -> PreparedModel:
    """Rewrite the user's model into one the engine trains correctly, or say why it cannot.

    Args:
        model: The user's model (left unchanged).
        trainable: Names of the parameters to train.
        loss: The configured loss (``cross_entropy``, ``mse``, ..., ``model_output``).
        loss_output: The model output the loss reads; None for a graph that does not compute the loss (a model
            prepared before it is cut, a pipeline stage or tensor-parallel piece before the last): its float outputs are
            what the trained path must reach.
        label_input: The label input's name (None for ``model_output``).
        repeatable_gathers: Read trained embedding tables with GatherND (:mod:`ortflow.graph.gradients.embedding`):
            the CPU gradient of Gather is not repeatable with more than one thread.
        fuse_gelu: How GELUs reach the engine: ``"as_exported"`` (False), ``"engine"`` (True: the engine's Gelu /
            FastGelu) or ``"cpu"`` (the tanh form with a fast CPU gradient);
            :func:`ortflow.graph.exports.gelu.gelu_rewrites`.
        keep: Tensor names no pass may remove (the pipeline cuts).

    Returns:
        The prepared model, the names the loss must read, parameters to freeze, and the report of what changed.

    Raises:
        GraphError: A node on the trained path has no gradient in the engine (naming node, op and fix).
    """
    skeleton, weights = _skeleton(model)
    model = skeleton
    report: list[dict] = []
    ran: list[str] = []
    buffers: list[str] = []
    loss_input, label = loss_output, label_input
    for name in PASSES:
        ran.append(name)
        if name == "untrainable_initializers":
            buffers = untrainable_initializers(model, trainable, report)
            trainable = trainable - set(buffers)
        elif name == "declare_optional_outputs":
            model = declare_optional_outputs(model, report)
        elif name == "sequences_to_tensors":
            model = sequences_to_tensors(model, report)
        elif name == "split_to_slices":
            model = split_to_slices(model, report)
        elif name == "shapes_from_inputs":
            model = shapes_from_inputs(model, report)
        elif name == "gelu_rewrites":
            model = gelu_rewrites(model, fuse_gelu, report, keep=keep or set())
        elif name == "gradient_fixes":
            model = gradient_fixes(model, report)
        elif name == "separate_repeated_inputs":
            model = separate_repeated_inputs(model, report)
        elif name == "declare_broadcast_shapes":
            model = declare_broadcast_shapes(model, report)
        elif name == "deterministic_gathers":
            if repeatable_gathers:
                model = deterministic_gathers(model, trainable, report)
        elif name == "flatten_logits":
            if loss == "cross_entropy" and label_input is not None and loss_output is not None:
                model, flat = flatten_logits(model, loss_output, label_input, report)
                loss_input, label = flat.scores, flat.labels
        elif name == "check_differentiable":
            reached = [loss_input] if loss_input is not None else _float_outputs(model)
            check_differentiable(model, trainable, reached)
    return PreparedModel(_with_weights(model, weights), loss_input, label, tuple(buffers), report, tuple(ran))


def _float_outputs(model: onnx.ModelProto) -> list[str]:
    """The graph's float outputs (what a graph without the loss sends on): the trained path must reach them."""
    types = elem_types(model)
    return [o.name for o in model.graph.output if types.get(o.name) in FLOAT_TYPES]


#: Initializers of at most this many values keep them in the skeleton the passes see (constants, not weights).
CONSTANT_ELEMENTS = 64


def _skeleton(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """A copy of ``model`` whose value-holding weights keep only name, type and dims; and those tensors."""
    weights = {t.name: t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL
               and int(np.prod(t.dims, dtype=np.int64)) > CONSTANT_ELEMENTS}
    skeleton = onnx.ModelProto()
    graph = model.graph
    for field_name in ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string"):
        setattr(skeleton, field_name, getattr(model, field_name))
    skeleton.opset_import.extend(model.opset_import)
    skeleton.metadata_props.extend(model.metadata_props)
    skeleton.functions.extend(model.functions)
    skeleton.graph.name, skeleton.graph.doc_string = graph.name, graph.doc_string
    for field_name in ("node", "input", "output", "value_info", "sparse_initializer", "quantization_annotation"):
        getattr(skeleton.graph, field_name).extend(getattr(graph, field_name))
    for tensor in graph.initializer:
        if tensor.name in weights:
            skeleton.graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        else:
            skeleton.graph.initializer.add().CopyFrom(tensor)
    return skeleton, weights


def _with_weights(skeleton: onnx.ModelProto, weights: dict[str, onnx.TensorProto]) -> onnx.ModelProto:
    """The skeleton with its initializers' original tensors back, in the same order (one copy of the values)."""
    tensors = [weights.get(t.name, t) for t in skeleton.graph.initializer]
    del skeleton.graph.initializer[:]
    skeleton.graph.initializer.extend(tensors)
    return skeleton
