"""Tensor (horizontal) parallel split, Megatron-LM style: find the wide layers, and each rank's slice of the model.

A **region** starts at column-split MatMuls (``x @ W`` with ``W`` a 2-D trainable initializer; each rank keeps a
block of ``W``'s columns and of the bias added right after) and ends at row-split MatMuls (the region's activation,
split on its last axis, times a 2-D trainable weight; each rank keeps the matching block of rows, so the product is a
partial sum that the ranks add: the forward all-reduce). In between the activation stays split on one axis through
element-wise ops, Reshape/Transpose (the head split: Q/K/V by heads), Softmax over another axis, MatMul of two
split tensors over a batch axis (attention scores and context), and ``Split`` of a fused QKV projection into equal
parts (its columns are sliced per part). The bias after a row-split MatMul is added once, after the all-reduce, so it
stays replicated, as does everything outside a region.

Reshape target shapes that carry the head count or the width (a Constant, or a Constant inside a Concat, as
``torch.onnx.export`` writes them) are rewritten for the local size; so are ``Split`` sizes. A candidate whose split
activation reaches something else (a graph output, an unknown op, a parameter that would need slicing) is kept
replicated, and the pass logs why. A split whose sizes ``hp`` does not divide is refused, naming the tensors.

A bias-free ``Gemm`` (:mod:`ortflow.graph.tensor_gemm`) is a weight product like ``MatMul``; its ``[out, in]`` weight
swaps the axes, as does a weight read as ``Transpose(W)`` (torch's ``nn.Linear`` on 3-D inputs), whose ``Transpose``
is a node of the region: each rank transposes its own slice in its piece, so the slice's gradient stays its own.
Embeddings and LM heads are split by vocabulary in regions of their own (:mod:`ortflow.graph.tensor_vocab`).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import helper

from ortflow.graph.onnx_tools import constant_values, node_label
from ortflow.graph.shapes import symbolic_shapes
from ortflow.graph.tensor_gemm import is_plain_gemm, transposed
from ortflow.graph.tensor_plan import Region, TensorPlan, TensorSplitError
from ortflow.graph.tensor_shapes import shape_entry, weight_of
from ortflow.graph.tensor_shard import shard_model
from ortflow.graph.tensor_vocab import plan_vocab

log = logging.getLogger(__name__)

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Erf", "Tanh", "Relu", "Gelu", "Sigmoid", "Identity", "Sqrt",
                "Neg", "Exp", "Log", "Cast", "Where", "FastGelu", "Abs", "Reciprocal", "LeakyRelu", "Elu"}


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    """Every tensor's dims (None where not a fixed number). ONNX Runtime's symbolic inference follows shapes computed
    from the inputs (Shape -> Gather -> Concat -> Reshape of dynamic-shape exports) where onnx's loses the fixed
    dims; onnx's (with data propagation) fills in what it does not reach."""
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    g = inferred.graph
    out = {}
    for vi in [*g.value_info, *g.input, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
    for name, dims in (symbolic_shapes(model) or {}).items():
        out[name] = [d if isinstance(d, int) else None for d in dims]
    for t in g.initializer:
        out[t.name] = list(t.dims)
    return out


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Walk:
    """One pass over the graph in order, propagating 'split on axis k' (k < 0, counted from the end) from seeds."""

    def __init__(self, model, trainable: set[str], seeds: set[int], size: int):
        self.g, self.trainable, self.size = model.graph, trainable, size
        self.shapes = _shapes(model)
        self.readers: dict[str, list[int]] = {}
        self.producers: dict[str, int] = {}
        for i, n in enumerate(self.g.node):
            for x in n.input:
                self.readers.setdefault(x, []).append(i)
            self.producers.update(dict.fromkeys(n.output, i))
        self.split: dict[str, int] = {}  # tensor -> split axis (negative)
        self.comp: dict[str, int] = {}  # tensor -> seed id (union-find root of its component)
        self.parent = {s: s for s in seeds}
        self.failed: dict[int, str] = {}
        self.node_comp: dict[int, int] = {}
        self.partial: dict[str, int] = {}  # row outputs -> component
        self.rows: dict[int, str] = {}  # node -> row weight
        self.biases: dict[int, str] = {}
        self.groups: dict[int, int] = {}  # seed node -> parts (Split after it)
        self.bias_of: dict[str, int] = {}  # tensor after the seed's bias add -> seed node
        self.rewrites: list[tuple[int, int, int, int, int]] = []  # (+ component)
        self.via_transpose: set[str] = set()  # weights read as Transpose(W) (torch's nn.Linear on 3-D inputs)
        for i, node in enumerate(self.g.node):
            if i in seeds:
                self.split[node.output[0]], self.comp[node.output[0]] = -1, i
                self.node_comp[i] = i
                self.bias_of[node.output[0]] = i
                continue
            self._visit(i, node)
        self.outputs = {o.name for o in self.g.output}
        for name, c in self.comp.items():
            if name in self.outputs:
                self.fail(c, f"its split activation '{name}' is a graph output")

    def find(self, c: int) -> int:
        while self.parent[c] != c:
            c = self.parent[c]
        return c

    def fail(self, c: int, why: str) -> None:
        self.failed.setdefault(self.find(c), why)

    def _visit(self, i: int, node) -> None:
        ins = [x for x in node.input if x in self.split]
        if not ins:
            return
        roots = {self.find(self.comp[x]) for x in ins}
        root = min(roots)
        for r in roots:  # merge components that meet (q @ k); a failure of either is the merged one's
            if r != root:
                if r in self.failed:
                    self.failed.setdefault(root, self.failed[r])
                self.parent[r] = root
        self.node_comp[i] = root
        why = self._propagate(i, node)
        if why:
            self.fail(root, f"{node.op_type} '{node_label(node)}': {why}")
            return
        for out in node.output:
            if out in self.split:
                self.comp[out] = root

    def _rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def _dim(self, name: str, axis: int):
        s = self.shapes.get(name)
        return None if s is None or -axis > len(s) else s[axis]

    def _propagate(self, i: int, node) -> str | None:  # noqa: C901 - one case per supported op
        op, x = node.op_type, node.input[0]
        axis = self.split.get(x)
        if op in ("MatMul", "Gemm"):
            a, b = node.input[:2]
            if op == "Gemm" and not is_plain_gemm(node):
                return "a Gemm with transA, alpha or a bias input (separate_gemm_biases takes biases out first)"
            weight = weight_of(self.g, b, self.trainable) if a in self.split and b not in self.split else None
            if weight is not None and self._rank(weight[0]) == 2:
                if self.split[a] != -1:
                    return "a weight MatMul reads an activation split on another axis than the last"
                if len(self.readers.get(weight[0], [])) > 1:
                    return f"the row weight '{weight[0]}' is also read elsewhere (tied)"
                self.rows[i] = weight[0]
                if weight[1]:
                    self.via_transpose.add(weight[0])
                self.partial[node.output[0]] = i
                return None
            if (op == "MatMul" and a in self.split and b in self.split and self.split[a] == self.split[b]
                    and self.split[a] <= -3):
                self.split[node.output[0]] = self.split[a]
                return None
            return "its inputs are not split the same way over a batch axis"
        if op == "Shape":
            return None
        if op == "Transpose":
            rank = self._rank(x)
            if rank is None:
                return "unknown rank"
            perm = _attr(node, "perm") or list(range(rank))[::-1]
            self.split[node.output[0]] = perm.index(rank + axis) - rank
            return None
        if op == "Reshape":
            return self._reshape(i, node, axis)
        if op == "Expand":  # to the shape of a tensor split alike (the engine's Where gradient fix writes these)
            maker = self._producer(node.input[1])
            shape_of = maker is not None and self.g.node[maker].op_type == "Shape"
            source = self.g.node[maker].input[0] if shape_of else None
            if source is None or self.split.get(source) != axis or self._rank(source) != self._rank(x):
                return "an Expand to a shape other than that of a tensor split alike"
            self.split[node.output[0]] = axis
            return None
        if op == "Split":
            return self._split(i, node, axis)
        if op == "Softmax" or op == "LogSoftmax":
            rank = self._rank(x)
            if rank is None or (_attr(node, "axis", -1) % rank) == rank + axis:
                return "softmax over the split axis"
            self.split[node.output[0]] = axis
            return None
        if op in _ELEMENTWISE:
            return self._elementwise(i, node)
        return "not an op the split follows"

    def _elementwise(self, i: int, node) -> str | None:
        axes = {self.split[x] for x in node.input if x in self.split}
        if len(axes) > 1:
            return "its inputs are split on different axes"
        (axis,) = axes
        for x in node.input:
            if not x or x in self.split:
                continue
            other = next((y for y in node.input if y != x), None)  # the split input (bias + x or x + bias)
            seed = self.bias_of.get(other) if node.op_type == "Add" else None
            if (x in self.trainable and seed is not None and axis == -1 and self._rank(x) == 1
                    and len(self.readers.get(x, [])) == 1 and other in self.split):
                self.biases[i] = x
                self.bias_of[node.output[0]] = seed
                continue
            if x in self.trainable:
                return f"the parameter '{x}' would need slicing"
            dim = self._dim(x, axis)
            if dim is not None and dim != 1:
                return f"'{x}' is not broadcast along the split axis"
        self.split[node.output[0]] = axis
        return None

    def _split(self, i: int, node, axis: int) -> str | None:
        seed = self.bias_of.get(node.input[0])
        rank = self._rank(node.input[0])
        if seed is None or rank is None or (_attr(node, "axis", 0) % rank) != rank + axis:
            return "a Split of a split activation other than a projection's output, along its columns"
        parts = len(node.output)
        sizes = constant_values(self.g, node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if sizes is not None and len(set(sizes.tolist())) != 1:
            return "a Split into unequal parts"
        self.groups[seed] = parts
        if sizes is not None:
            for k, v in enumerate(sizes.tolist()):
                self.rewrites.append((i, 1, k, int(v), seed))
        for out in node.output:
            self.split[out] = axis
        return None

    def _reshape(self, i: int, node, axis: int) -> str | None:
        x, out = node.input[0], node.output[0]
        s_in, s_out = self.shapes.get(x), self.shapes.get(out)
        if s_in is None or s_out is None or None in s_in[axis:]:
            return "shapes around the Reshape are not known (export with fixed sizes)"
        suffix = int(np.prod(s_in[axis:]))
        # The leftmost axis b whose trailing dims (all fixed: the batch and sequence may be dynamic before them)
        # hold exactly the split axis and the dims after it.
        found = [b for b in range(1, len(s_out)) if None not in s_out[b:]
                 and int(np.prod(s_out[b:])) == suffix and s_out[b] > 1]
        if not found:
            return "the split axis does not map onto one axis of the new shape"
        b = found[0]
        spec = self._shape_entry(i, node.input[1], b)
        if isinstance(spec, str):
            return spec
        node_index, pos, element, value = spec
        if value > 0:
            self.rewrites.append((node_index, pos, element, value, self.find(self.comp[x])))
        elif value == 0 and b != len(s_in) + axis:
            return "the new shape copies (0) the split axis from another position"
        self.split[out] = b - len(s_out)
        if x in self.bias_of and axis == -1 and b == len(s_out) - 1:  # [B*T, 3D] -> [B, T, 3D] before a fused Split
            self.bias_of[out] = self.bias_of[x]
        return None

    def _producer(self, name: str):
        return self.producers.get(name)

    def _shape_entry(self, i: int, name: str, b: int):
        """Where entry ``b`` of a Reshape's shape lives: (node, input, element, value), or why it cannot change."""
        return shape_entry(self.g, self.shapes, self.producers, i, 1, b)


def _candidates(graph: onnx.GraphProto, trainable: set[str], shapes: dict[str, list]) -> dict[int, str]:
    """MatMul (or bias-free Gemm) nodes whose second input is a 2-D trainable weight read only there: node index ->
    weight."""
    reads: dict[str, int] = {}
    for n in graph.node:
        for x in n.input:
            reads[x] = reads.get(x, 0) + 1
    found = {}
    for i, n in enumerate(graph.node):
        if n.op_type == "MatMul" or is_plain_gemm(n):
            weight = weight_of(graph, n.input[1], trainable)
            if weight is not None and len(shapes.get(weight[0], [])) == 2 and reads[weight[0]] == 1:
                found[i] = weight[0]
    return found


def plan_tensor_split(model: onnx.ModelProto, trainable: list[str] | set[str], size: int,
                      embedded: frozenset[str] = frozenset()) -> TensorPlan:
    """Find the regions to split over ``size`` ranks (pure; nothing is changed). ``embedded``: tables the whole model
    embeds, when ``model`` is one pipeline stage of it (its LM head may be tied to another stage's embedding).

    Raises:
        TensorSplitError: ``size`` does not divide a split width or head count (names them and the fix), or no
            region was found.
    """
    trainable = set(trainable)
    candidates = _candidates(model.graph, trainable, _shapes(model))
    seeds, kept = set(candidates), {}
    for n in model.graph.node:  # a layer the pass could split once its bias is taken out (configure does)
        if n.op_type == "Gemm" and not is_plain_gemm(n) and n.input[1] in trainable:
            kept[n.input[1]] = "a Gemm with transA, alpha or a bias input (separate_gemm_biases takes biases out first)"
    while True:
        walk = _Walk(model, trainable, seeds, size)
        downstream = {s for s in seeds if model.graph.node[s].input[0] in walk.split}
        if downstream:  # fed by another seed's activation: a row-split MatMul, not a seed
            seeds -= downstream
            continue
        failed = {s for s in seeds if walk.find(s) in walk.failed}
        ends = {walk.find(walk.node_comp[r]) for r in walk.rows}
        unended = {s for s in seeds if walk.find(s) not in ends} - failed
        for s in failed | unended:
            kept[candidates[s]] = walk.failed.get(walk.find(s), "its activation never reaches a row-split MatMul")
        if not (failed | unended):
            break
        seeds -= failed | unended
    regions = _regions(model.graph, walk, seeds, candidates)
    for r in walk.rows.values():
        kept.pop(r, None)
    regions += plan_vocab(model, trainable, size, walk.shapes, set(TensorPlan(size, regions, [], {}).slicing()), kept,
                          embedded)
    plan = TensorPlan(size, regions, [w[:4] for w in walk.rewrites], kept)
    _check_sizes(model, plan, walk)
    return plan


def _regions(graph, walk: _Walk, seeds: set[int], candidates: dict[int, str]) -> list[Region]:
    by_root: dict[int, Region] = {}
    for s in sorted(seeds):
        r = by_root.setdefault(walk.find(s), Region())
        r.columns.append(candidates[s])
        if transposed(graph.node[s]) or graph.node[s].input[1] != candidates[s]:  # Gemm transB=1, or Transpose(W)
            r.transposed.append(candidates[s])
        if graph.node[s].input[1] != candidates[s]:
            r.nodes.append(walk.producers[graph.node[s].input[1]])
        if walk.groups.get(s, 1) > 1:
            r.groups[candidates[s]] = walk.groups[s]
        x = graph.node[s].input[0]
        if x not in r.inputs:
            r.inputs.append(x)
    for i, c in sorted(walk.node_comp.items()):
        r = by_root[walk.find(c)]
        r.nodes.append(i)
        if i in walk.rows:
            r.rows.append(walk.rows[i])
            if transposed(graph.node[i]) or walk.rows[i] in walk.via_transpose:
                r.transposed.append(walk.rows[i])
            if walk.rows[i] in walk.via_transpose:
                r.nodes.append(walk.producers[graph.node[i].input[1]])
            r.outputs.append(graph.node[i].output[0])
        if i in walk.biases:
            r.biases.append(walk.biases[i])
            seed = walk.bias_of[graph.node[i].output[0]]
            if walk.groups.get(seed, 1) > 1:
                r.groups[walk.biases[i]] = walk.groups[seed]
    for r in by_root.values():
        r.nodes.sort()
    return [by_root[k] for k in sorted(by_root)]


def _check_sizes(model, plan: TensorPlan, walk: _Walk) -> None:
    if not plan.regions:
        raise TensorSplitError(
            "distributed.horizontal_parallel_size > 1 found no layer to split (a MatMul by a 2-D weight whose output "
            f"reaches a second weight MatMul through element-wise ops and head reshapes); kept: {plan.kept}; use 1"
        )
    bad = []
    for name, (axis, parts) in plan.slicing().items():
        dim = walk.shapes[name][axis if len(walk.shapes[name]) > 1 else 0]
        if dim % (parts * plan.size):
            bad.append(f"{name} {walk.shapes[name]} (axis {axis}{f', {parts} parts' if parts > 1 else ''})")
    for i, _, _, value in plan.rewrites:
        if value % plan.size:
            bad.append(f"{model.graph.node[i].op_type} '{node_label(model.graph.node[i])}' size {value} (heads?)")
    if bad:
        raise TensorSplitError(
            f"distributed.horizontal_parallel_size {plan.size} does not divide {bad}: choose a size that divides "
            "the number of heads and the widths, or 1"
        )


def describe(plan: TensorPlan) -> list[str]:
    """One line per region and one for what stays replicated (the pass logs these)."""
    lines = [f"region {k}: columns {r.columns} (+ biases {r.biases}), rows {r.rows}; all-reduce after {r.outputs}"
             + (f"; fused parts {r.groups}" if r.groups else "") + (f"; [out, in] {r.transposed}" if r.transposed
                                                                     else "")
             if not r.vocab else f"region {k}: vocabulary split of {list(r.vocab)} (axis {list(r.vocab.values())[0]})"
             f" in {'the LM head ' + str(list(r.heads)) if r.heads else 'the embedding ' + str(r.outputs)}; "
             f"all-reduce after {r.outputs}" for k, r in enumerate(plan.regions)]
    lines += [f"kept replicated: {w} ({why})" for w, why in sorted(plan.kept.items())]
    return lines


def split_for_rank(model: onnx.ModelProto, trainable, size: int, rank: int,
                   report: list[dict] | None = None) -> tuple[onnx.ModelProto, TensorPlan]:
    """Plan (logging what it split and kept) and shard for ``rank``: the pass of configure."""
    plan = plan_tensor_split(model, trainable, size)
    lines = describe(plan)
    if rank == 0:
        log.info("tensor_parallel %d: %s", size, "; ".join(lines))
        if report is not None:
            report.append({"pass": "tensor_parallel", "changes": lines})
    return shard_model(model, plan, rank), plan
