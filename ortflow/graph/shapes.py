"""Shapes of computed tensors read from the inputs: ``Shape(x)`` of an activation becomes the same shape built from
the graph inputs' ``Shape`` and constants.

Exports write their shape arithmetic from the activations: Hugging Face's GPT-2 reads ``hidden_states.size()`` in
every block (``Shape`` of a LayerNorm output, ``Gather``, ``Concat``, ``Reshape``), and its final ``view`` reads the
shape of the embedding sum. The values only depend on the input's dims and on the model's fixed sizes, never on a
trained value; but as written they descend from parameters, so a pipeline cut between two blocks would have to carry
an ``int64`` tensor that carries no gradient, and a tensor-parallel split would see shapes it cannot rewrite.

The pass infers every tensor's shape symbolically (ONNX Runtime's symbolic shape inference: dims as expressions of
the inputs' named dims) and replaces each ``Shape`` of a computed tensor whose dims are all either fixed numbers or a
named dim of a graph input by ``Concat`` of ``Gather(Shape(input), axis)`` and int64 constants. Its output keeps
its name, so readers are unchanged; it computes the same values at every batch and sequence length (the named dims
are the inputs' own). A ``Shape`` whose dims it cannot express (an unnamed or derived dim such as ``seq + past``)
is left as it was. No value the model computes changes, and no initializer is read or changed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
from collections import OrderedDict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.onnx_tools import Names, attribute, infer_shapes, int64_constant, node_label, report_change

log = logging.getLogger(__name__)


def _input_dims(graph: onnx.GraphProto) -> dict[str, tuple[str, int]]:
    """Named dim -> (the first graph input that has it, its axis)."""
    inits = {t.name for t in graph.initializer}
    found: dict[str, tuple[str, int]] = {}
    for value in graph.input:
        if value.name in inits:
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and dim.dim_param not in found:
                found[dim.dim_param] = (value.name, axis)
    return found


def symbolic_shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]] | None:
    """Every tensor's dims, as ints and named dims (the inputs' own names where they follow from them), from ONNX
    Runtime's symbolic shape inference on a copy of ``model`` whose float initializers hold no values; None when the
    inference fails."""
    return _symbolic_shapes(_without_values(model))


#: Results of :func:`_symbolic_shapes` by the sha256 of the model it read: configure infers the same graph several
#: times (the whole model when it plans a split and again when it builds it, a piece before and after a pass that
#: changed nothing in it), and the inference (sympy) is most of what configure spends outside the engine.
_INFERRED: OrderedDict[str, dict[str, list[int | str | None]] | None] = OrderedDict()
_INFERRED_ENTRIES = 64


def _symbolic_shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]] | None:
    """:func:`_infer_symbolic_shapes`, once per distinct model (the bytes of a model whose float initializers hold no
    values are small) in this process."""
    key = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
    if key in _INFERRED:
        _INFERRED.move_to_end(key)
    else:
        _INFERRED[key] = _infer_symbolic_shapes(model)
        if len(_INFERRED) > _INFERRED_ENTRIES:
            _INFERRED.popitem(last=False)
    shapes = _INFERRED[key]
    return None if shapes is None else {name: list(dims) for name, dims in shapes.items()}


def _infer_symbolic_shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]] | None:
    """Every tensor's dims (ints and named dims) from ONNX Runtime's symbolic shape inference, or None if it fails.

    Where the inference had to guess that two of the graph inputs' named dims are equal (``auto_merge`` of, say, the
    batch and the sequence length of a piece whose received activation has unnamed dims), it picks one name in set
    order, which changes from run to run: every dim named by any of the merged names is reported unknown (None)
    instead, so no pass writes a shape from a guess. The inference renames the inputs' dims to the names it merged
    them into, so the names are taken from the graph inputs before it runs, and a merge counts as a guess when the
    names merged into one (through any chain of merges) include two of them.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    named = {d.dim_param for value in model.graph.input for d in value.type.tensor_type.shape.dim if d.dim_param}
    try:
        inference = SymbolicShapeInference(2**31 - 1, True, False, 0)  # int_max, auto_merge, guess rank, verbose
        inference.dispatcher_["ConstantOfShape"] = functools.partial(_constant_of_shape, inference)
        done = False
        inference._preprocess(model)
        while inference.run_:
            done = inference._infer_impl()
        inference._update_output_from_vi()
    except Exception as err:  # noqa: BLE001 - the inference raises many kinds on graphs it cannot follow
        log.debug("symbolic shape inference failed: %s", err)
        return None
    if not done:
        return None
    guessed = _guessed_merges(inference.suggested_merge_, named | set(inference.input_symbols_))
    shapes = {}
    for value in inference.out_mp_.graph.value_info:
        tensor = value.type.tensor_type
        if tensor.HasField("shape"):
            shapes[value.name] = [(None if d.dim_param in guessed else d.dim_param) if d.HasField("dim_param") else (
                int(d.dim_value) if d.HasField("dim_value") else None) for d in tensor.shape.dim]
    return shapes


def _constant_of_shape(inference, node: onnx.NodeProto) -> None:
    """ONNX Runtime's inference of a ``ConstantOfShape`` (``SymbolicShapeInference._infer_ConstantOfShape``), with the
    int64 tensor of a known shape that it records for later shape arithmetic held as a read-only broadcast of its one
    value instead of a new array: the same values, dtype and shape, without the memory. The tensor-parallel split's
    probes (:mod:`ortflow.graph.tensor_parallel.tensor_shapes`) set the sequence to 10007, where T5's ``[T, T]``
    relative position buckets would be 800 MB each."""
    from onnxruntime.tools.symbolic_shape_infer import get_attribute, get_shape_from_sympy_shape, is_literal

    sympy_shape = inference._get_int_or_float_values(node)[0]
    info = inference.known_vi_[node.output[0]]
    if sympy_shape is not None:
        if not isinstance(sympy_shape, list):
            sympy_shape = [sympy_shape]
        inference._update_computed_dims(sympy_shape)
        if info.type.tensor_type.elem_type == onnx.TensorProto.INT64 and all(is_literal(x) for x in sympy_shape):
            shape = [int(x) for x in sympy_shape]
            one = np.ones([1] * len(shape), dtype=np.int64) * numpy_helper.to_array(get_attribute(node, "value", 0))
            inference.sympy_data_[node.output[0]] = np.broadcast_to(one, np.broadcast_shapes(shape, one.shape))
    else:  # a new symbolic shape, as long as the shape input
        sympy_shape = inference._new_symbolic_shape(inference._get_shape(node, 0)[0], node)
    info.CopyFrom(helper.make_tensor_value_info(node.output[0], info.type.tensor_type.elem_type,
                                                get_shape_from_sympy_shape(sympy_shape)))


def _guessed_merges(merges: dict, inputs: set[str]) -> set[str]:
    """The names in groups of merged dims (``merges``: name -> the name it became, possibly through a chain) that hold
    two or more of the graph inputs' dim names: all of them, as every one now stands for a guess."""
    def root(name):
        seen = set()
        while name in merges and name not in seen:
            seen.add(name)
            name = merges[name]
        return name

    groups: dict = {}
    for name in {*merges, *merges.values()}:
        groups.setdefault(root(name), set()).add(name)
    return {str(n) for group in groups.values() if len(group & inputs) >= 2 for n in group}


def shapes_from_inputs(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Replace ``Shape`` of computed tensors by the same shape read from the graph inputs (module docstring).

    Args:
        model: The model (left unchanged); initializers may hold no values (the pass reads none).
        report: When given, receives one entry describing the change.

    Returns:
        A new model (the same object's copy when nothing is rewritten).
    """
    graph = model.graph
    computed = {out for node in graph.node for out in node.output if out}
    targets = [i for i, n in enumerate(graph.node) if n.op_type == "Shape" and n.domain in ("", "ai.onnx")
               and n.input[0] in computed]
    dims_of = _input_dims(graph)
    if not targets or not dims_of:
        return copy.deepcopy(model)
    shapes = _symbolic_shapes(_without_values(model))
    if shapes is None:
        return copy.deepcopy(model)
    model = copy.deepcopy(model)
    graph = model.graph
    names = Names(graph)
    input_shapes: dict[str, str] = {}
    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    changes = []
    for index in targets:
        node = graph.node[index]
        dims = shapes.get(node.input[0])
        if dims is None:
            continue
        start, end = attribute(node, "start"), attribute(node, "end")
        dims = dims[slice(start, end)]
        if not dims or any(not isinstance(d, int) and d not in dims_of for d in dims):
            continue
        label = node_label(node)
        nodes: list[onnx.NodeProto] = []
        parts = []
        for d in dims:
            if isinstance(d, int):
                const, name = int64_constant(names, f"{label}.dim", [d])
                nodes.append(const)
            else:
                source, axis = dims_of[d]
                if source not in input_shapes:
                    input_shapes[source] = names.new(f"{source}.shape")
                    nodes.append(helper.make_node("Shape", [source], [input_shapes[source]],
                                                  name=names.new(f"{source}/Shape")))
                const, index_name = int64_constant(names, f"{label}.axis", [axis])
                name = names.new(f"{label}.{d}")
                nodes += [const, helper.make_node("Gather", [input_shapes[source], index_name], [name],
                                                  name=names.new(f"{label}/Gather"), axis=0)]
            parts.append(name)
        nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=names.new(f"{label}/FromInputs"), axis=0))
        new_nodes[index] = nodes
        changes.append(f"Shape '{label}' of '{node.input[0]}' read from the inputs as {dims}")
    if not new_nodes:
        return model
    rebuilt = []
    for i, node in enumerate(graph.node):
        rebuilt.extend(new_nodes.get(i, [node]))
    del graph.node[:]
    graph.node.extend(rebuilt)
    report_change("shapes_from_inputs", changes, report)
    return model


def _without_values(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for the shape inference: float initializers as graph inputs of their type and dims (no values read),
    int initializers kept (the inference may read shape constants)."""
    copy_model = onnx.ModelProto()
    copy_model.CopyFrom(model)
    graph = copy_model.graph
    keep, moved = [], []
    for tensor in graph.initializer:
        has_values = tensor.raw_data or tensor.int64_data or tensor.int32_data or tensor.float_data
        if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and has_values:
            keep.append(tensor)
        else:
            moved.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    del graph.initializer[:]
    graph.initializer.extend(keep)
    known = {i.name for i in graph.input}
    graph.input.extend(v for v in moved if v.name not in known)
    del graph.value_info[:]
    _shape_ranges_as_slices(graph)
    _constants_as_tensors(graph)
    _reductions_as_sums(graph)
    return copy_model


#: Reductions whose axes are an input from opset 18 on, which ONNX Runtime's symbolic shape inference has no rule for
#: (it has ReduceSum's): the output's shape is ReduceSum's of the same input, axes and ``keepdims``.
_REDUCTIONS = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
               "ReduceSumSquare"}


def _reductions_as_sums(graph: onnx.GraphProto) -> None:
    """A reduction that reads its axes as an input (``ReduceMean(x, axes)``, the dynamo exporter's ``x.mean(-1,
    keepdim=True)`` at opset 18 and later: T5's and Llama's RMS norms) as ``ReduceSum``, whose output has the same
    shape: ONNX Runtime's symbolic shape inference has no rule for the others and stops at the first one, so no shape
    after it would be known."""
    for node in graph.node:
        if node.op_type in _REDUCTIONS and node.domain in ("", "ai.onnx") and len(node.input) > 1:
            node.op_type = "ReduceSum"


_CONSTANT_FORMS = {"value_int": (np.int64, "i"), "value_ints": (np.int64, "ints"), "value_float": (np.float32, "f"),
                   "value_floats": (np.float32, "floats")}


def _constants_as_tensors(graph: onnx.GraphProto) -> None:
    """``Constant(value_int=...)`` and the other scalar/list forms (the dynamo exporter's) as ``Constant(value=...)``:
    ONNX Runtime's symbolic shape inference reads only ``value``."""
    for node in graph.node:
        attr = node.attribute[0] if node.op_type == "Constant" and len(node.attribute) == 1 else None
        if attr is None or attr.name not in _CONSTANT_FORMS:
            continue
        dtype, field = _CONSTANT_FORMS[attr.name]
        raw = getattr(attr, field)
        value = np.asarray(list(raw) if field in ("ints", "floats") else raw, dtype=dtype)
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))


def _shape_ranges_as_slices(graph: onnx.GraphProto) -> None:
    """``Shape(x, start, end)`` (opset 15, the dynamo exporter's ``x.size(i)``) as ``Slice(Shape(x))``: ONNX
    Runtime's symbolic shape inference ignores the range and takes the whole shape."""
    names = Names(graph)
    rebuilt = []
    for node in graph.node:
        start, end = attribute(node, "start"), attribute(node, "end")
        if node.op_type != "Shape" or (start is None and end is None):
            rebuilt.append(node)
            continue
        whole = names.new(f"{node.output[0]}/whole")
        bounds = [int64_constant(names, f"{node.output[0]}/{tag}", [v]) for tag, v in
                  (("start", start or 0), ("end", end if end is not None else 2**62))]
        rebuilt += [helper.make_node("Shape", [node.input[0]], [whole], name=names.new(f"{whole}/node")),
                    *(c for c, _ in bounds),
                    helper.make_node("Slice", [whole, *(b for _, b in bounds)], [node.output[0]],
                                     name=names.new(f"{node.output[0]}/range"))]
    del graph.node[:]
    graph.node.extend(rebuilt)


def _known(value: onnx.ValueInfoProto, dims_of: dict[str, tuple[str, int]]) -> bool:
    """Whether ``value``'s declared shape has a rank and every dim a fixed number or a named dim of a graph input."""
    tensor = value.type.tensor_type
    return tensor.HasField("shape") and all(d.HasField("dim_value") or d.dim_param in dims_of for d in tensor.shape.dim)


#: Ops whose gradient sums over the axes an input was broadcast along (the engine reads the input's declared shape).
_BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min"}


def _adds_a_broadcast_axis(old: onnx.ValueInfoProto, dims: list[int | str | None]) -> bool:
    """Whether ``dims``, known in part (None where the inference cannot tell a dim), name an axis of length 1 that
    ``old`` does not: declared with the other dims left unknown, it is an axis the engine's gradient sums over (it
    reads two unknown dims as equal, so an operand of unknown dims gets the broadcast output's gradient unsummed)."""
    tensor = old.type.tensor_type
    old_dims = list(tensor.shape.dim) if tensor.HasField("shape") else []
    return any(d == 1 and (len(old_dims) != len(dims) or old_dims[k].dim_value != 1) for k, d in enumerate(dims))


def declare_broadcast_shapes(model: onnx.ModelProto, report: list[dict] | None = None) -> onnx.ModelProto:
    """Declare (``value_info``) the shapes of broadcast operands that onnx's inference leaves unknown but symbolic
    inference knows, so the engine's gradient of the broadcasting op sums over the broadcast axes.

    Hugging Face's BERT adds position embeddings ``[1, seq, C]`` (a Gather of ids sliced from a ``[1, 512]`` buffer)
    to ``[batch, seq, C]``; onnx's shape inference cannot tell the slice's first dim, so the engine's ``Add``
    gradient passes the ``[batch, seq, C]`` gradient on unreduced, and the position table's ``GatherGrad`` reads
    ``batch`` times more ids than there are: wrong gradients and writes past the buffer (measured with
    onnxruntime-training 1.19.2: a corrupted heap under an exact-size arena, an index assertion in ``GatherNDGrad``).
    Declared as ``[1, seq, C]``, the gradient is summed over the batch first. Only operands whose every dim is a fixed
    number or a named dim of a graph input are declared; nothing else changes.
    """
    graph = model.graph
    dims_of = _input_dims(graph)
    operands = {x for n in graph.node if n.op_type in _BROADCASTING and n.domain in ("", "ai.onnx")
                for x in n.input if x}
    if not operands or not dims_of:
        return copy.deepcopy(model)
    try:
        known = infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - onnx raises several kinds; nothing is declared then
        return copy.deepcopy(model)
    declared = {v.name: v for v in [*known.value_info, *known.input, *known.output]}
    fixed = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    # Only operands whose shape onnx's inference leaves partly unknown are declared: when there are none (an MLP, a
    # model of fixed sizes), the symbolic inference (sympy, most of a small model's configure) is not run at all.
    unknown = [name for name in sorted(operands - fixed) if name in declared and not _known(declared[name], dims_of)]
    if not unknown:
        return copy.deepcopy(model)
    shapes = symbolic_shapes(model)
    if shapes is None:
        return copy.deepcopy(model)
    model = copy.deepcopy(model)
    changes = []
    for name in unknown:
        dims = shapes.get(name)
        old = declared[name]
        if dims is None or any(d is not None and not isinstance(d, int) and d not in dims_of for d in dims):
            continue
        old_dims = old.type.tensor_type.shape.dim
        if len(old_dims) == len(dims) and all(d.HasField("dim_value") or d.dim_param in dims_of for d in old_dims):
            continue  # already known (a declaration without a shape, of a scalar)
        if None in dims and not _adds_a_broadcast_axis(old, dims):
            continue
        elem = old.type.tensor_type.elem_type
        for existing in [v for v in model.graph.value_info if v.name == name]:
            model.graph.value_info.remove(existing)
        model.graph.value_info.append(helper.make_tensor_value_info(name, elem, list(dims)))
        changes.append(f"'{name}' declared {dims}")
    report_change("declare_broadcast_shapes", changes, report)
    return model
