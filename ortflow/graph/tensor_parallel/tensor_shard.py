"""Rank ``r``'s model of a tensor-parallel split: its slices of the split weights, local sizes in the shapes.

The inverse (whole tensors from every rank's slices) is :func:`ortflow.tensor_slices.merge_slices`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.exports.gelu import declare_fused_types
from ortflow.graph.onnx_tools import Names, constant_values
from ortflow.graph.tensor_parallel.tensor_bias import clone_path
from ortflow.graph.tensor_parallel.tensor_kv import slice_heads
from ortflow.graph.tensor_parallel.tensor_plan import TensorParallelPlan
from ortflow.graph.tensor_parallel.tensor_vocab import shard_vocab
from ortflow.tensor_slices import slice_tensor


def weight_values(tensor: onnx.TensorProto, folder: Path | None) -> np.ndarray:
    """The values of one initializer: held in the proto, or read alone from its external data file (``folder``: where
    the file names are relative to), leaving ``tensor`` a reference."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    if folder is None:
        raise ValueError(f"initializer '{tensor.name}' is in external data and no folder was given to read it from")
    loaded = onnx.TensorProto()
    loaded.CopyFrom(tensor)
    onnx.external_data_helper.load_external_data_for_tensor(loaded, str(folder))
    loaded.data_location = onnx.TensorProto.DEFAULT
    del loaded.external_data[:]
    return numpy_helper.to_array(loaded)


def slice_dims(dims: list[int], axis: int, parts: int | list[int], size: int, rank: int) -> list[int]:
    """The dims of :func:`slice_tensor`'s block of a tensor of ``dims`` (computed on a vector along ``axis``)."""
    axis = axis if len(dims) > 1 else 0
    along = np.zeros([d if i == axis else 1 for i, d in enumerate(dims)], np.int8)
    return [*dims[:axis], slice_tensor(along, axis, parts, size, rank).shape[axis], *dims[axis + 1:]]


def shard_model(model: onnx.ModelProto, plan: TensorParallelPlan, rank: int,
                weights: Path | None = None, values: bool = True) -> onnx.ModelProto:
    """Rank ``rank``'s model: its slices of the split weights, local head counts and widths in the shapes.

    A split weight in external data (a model past 2 GB) is read alone from its file in ``weights``, sliced, and its
    slice held in the rank's model; the replicated weights stay references into the files. So the rank's model holds
    its share of the split weights, and reading them never holds more than one whole weight at a time. Without
    ``values`` (to check how the pieces are cut) a split weight's slice is its name, type and dims only: none is read.
    """
    model = copy.deepcopy(model)
    graph, size = model.graph, plan.size
    slicing = plan.slicing()
    for t in graph.initializer:
        if t.name in slicing:
            axis, parts = slicing[t.name]
            if not values:
                sliced = onnx.TensorProto(name=t.name, data_type=t.data_type,
                                          dims=slice_dims(list(t.dims), axis, parts, size, rank))
                t.CopyFrom(sliced)
                continue
            whole = weight_values(t, weights)
            t.CopyFrom(numpy_helper.from_array(slice_tensor(whole, axis, parts, size, rank), t.name))
            del whole
    names = Names(graph)
    made = {n.output[0] for n in graph.node} if any(r.members for r in plan.regions) else set()
    for r in plan.regions:  # names the plan chose for the nodes a vocabulary split adds
        for m in r.members:
            assert names.new(m) == m or m in made, m
    dims = {t.name: list(t.dims) for t in graph.initializer}
    replaced: dict[int, list] = {}
    for r in plan.regions:
        if r.vocab:
            replaced.update(shard_vocab(graph, r, size, rank, names, dims))
    new_nodes: dict[int, list] = {}
    by_input: dict[tuple[int, int], dict[int, int]] = {}
    for i, pos, element, value in plan.rewrites:
        by_input.setdefault((i, pos), {})[element] = value // size
    for (i, pos), changes in sorted(by_input.items()):
        node = graph.node[i]
        values = constant_values(graph, node.input[pos]).copy()
        for element, value in changes.items():
            values.reshape(-1)[element] = value
        out = names.new(f"{node.input[pos]}.tp{size}")
        tensor = numpy_helper.from_array(values, out)
        new_nodes.setdefault(i, []).append(helper.make_node("Constant", [], [out], name=names.new(out), value=tensor))
        node.input[pos] = out
    for i, pos, axis, full in plan.slices:  # replicated keys/values: the block this rank's query heads read
        new_nodes.setdefault(i, []).extend(slice_heads(graph, names, graph.node[i], pos, axis, full, size, rank))
    for i, x, path, outs in plan.bias_paths:  # each split attention's bias from the rank's columns of the table
        new_nodes.setdefault(i, []).extend(clone_path(graph, names, path, outs, f"tp{size}"))
        node = graph.node[i]
        node.input[list(node.input).index(x)] = outs[-1]
    replaced.update({i: [] for i in plan.bias_nodes})
    split = {out for r in plan.regions for i in r.nodes for out in graph.node[i].output} | {
        m for r in plan.regions for m in r.members} | {graph.node[i].output[0] for i in plan.bias_nodes}
    ordered = []
    for i, node in enumerate(graph.node):
        ordered += new_nodes.get(i, []) + replaced.get(i, [node])
    del graph.node[:]
    graph.node.extend(ordered)
    # Shapes of the split tensors changed (inference recomputes them); the replicated tensors' declared shapes hold on
    # every rank (graph/shapes.py declares broadcast operands that inference cannot tell: keep them for the pieces).
    kept = [v for v in graph.value_info if v.name not in split]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return declare_fused_types(model)  # ...except through com.microsoft ops (fused GELUs, graph/exports/gelu.py)
