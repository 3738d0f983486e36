"""Rank ``r``'s model of a tensor-parallel split: its slices of the split weights, local sizes in the shapes.

The inverse (whole tensors from every rank's slices) is :func:`ortflow.checkpoints.tp.merge_slices`.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.exports.gelu import declare_fused_types
from ortflow.graph.onnx_tools import Names, constant_values
from ortflow.graph.tensor_parallel.tensor_plan import TensorParallelPlan
from ortflow.graph.tensor_parallel.tensor_vocab import shard_vocab


def slice_tensor(value: np.ndarray, axis: int, parts: int, size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s block of ``value`` along ``axis`` (with ``parts``: its block of every part, concatenated)."""
    axis = axis if value.ndim > 1 else 0
    split = np.split(value, parts, axis=axis)
    return np.concatenate([np.split(p, size, axis=axis)[rank] for p in split], axis=axis)


def shard_model(model: onnx.ModelProto, plan: TensorParallelPlan, rank: int) -> onnx.ModelProto:
    """Rank ``rank``'s model: its slices of the split weights, local head counts and widths in the shapes."""
    model = copy.deepcopy(model)
    graph, size = model.graph, plan.size
    slicing = plan.slicing()
    for t in graph.initializer:
        if t.name in slicing:
            axis, parts = slicing[t.name]
            t.CopyFrom(numpy_helper.from_array(slice_tensor(numpy_helper.to_array(t), axis, parts, size, rank), t.name))
    names = Names(graph)
    for r in plan.regions:  # names the plan chose for the nodes a vocabulary split adds
        for m in r.members:
            assert names.new(m) == m or m in {n.output[0] for n in graph.node}, m
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
    split = {out for r in plan.regions for i in r.nodes for out in graph.node[i].output} | {
        m for r in plan.regions for m in r.members}
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
