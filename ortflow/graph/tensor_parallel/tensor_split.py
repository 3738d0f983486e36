"""Tensor-parallel split, Megatron-LM style: find the wide layers, and each rank's slice of the model.

A **region** starts at column-split MatMuls (``x @ W`` with ``W`` a 2-D trainable initializer; each rank keeps a
block of ``W``'s columns and of the bias added right after) and ends at row-split MatMuls (the region's activation,
split on its last axis, times a 2-D trainable weight; each rank keeps the matching block of rows, so the product is a
partial sum that the ranks add: the forward all-reduce). In between the activation stays split on one axis through
element-wise ops, Reshape/Transpose (Q/K/V by heads), Unsqueeze/Squeeze, Slice and Concat along another axis (RoPE's
``rotate_half`` of the head dim), Expand over another axis (grouped-query attention's ``repeat_kv``: each rank's
key/value heads are those its query heads read), Softmax over another axis, MatMul of two split tensors over a batch
axis (scores and context), the parts of a fused projection (QKV, gate and up) read by a ``Split`` or by ``Slice``s of
its columns (each rank keeps its block of every part: :mod:`ortflow.graph.tensor_parallel.tensor_fused`), and Expand
of a replicated tensor to a split tensor's ``Shape`` (the Where gradient fix on a causal mask's fill). The bias after a
row-split MatMul is added once, after the all-reduce; it and everything outside a region stay replicated.

Shape entries that carry a head count or width are rewritten for the local size where they are constants
(:mod:`ortflow.graph.tensor_parallel.tensor_shapes` follows the exporters' shape arithmetic); sizes read from a split
tensor's ``Shape`` follow by themselves. A candidate whose activation reaches something else (a graph output, an unknown
op, a parameter that would need slicing) stays replicated, with the reason (a WARNING). Key/value projections whose
heads ``tp`` does not divide (multi-query attention) stay whole on every rank, before the region, whose attention
products read each rank's block of their heads (:mod:`ortflow.graph.tensor_parallel.tensor_kv`). A size ``tp`` that
does not divide a width or the query heads (of each part of a fused QKV projection) is refused, naming the projections
and the sizes that fit.

A bias-free ``Gemm`` (:mod:`ortflow.graph.tensor_parallel.tensor_gemm`) is a weight product like ``MatMul``; its ``[out,
in]`` weight swaps the axes, as does a weight read as ``Transpose(W)`` (torch's ``nn.Linear`` on 3-D inputs), whose
``Transpose`` is a node of the region: each rank transposes its own slice in its piece, so the slice's gradient stays
its own. Embeddings and LM heads are split by vocabulary in regions of their own
(:mod:`ortflow.graph.tensor_parallel.tensor_vocab`).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import node_label
from ortflow.graph.tensor_parallel.tensor_axes import moved_axis, reshape_axis
from ortflow.graph.tensor_parallel.tensor_fused import FusedParts, keeps_axis, slice_part, split_parts
from ortflow.graph.tensor_parallel.tensor_gemm import is_plain_gemm, transposed
from ortflow.graph.tensor_parallel.tensor_kv import replicated_kv, tp_note
from ortflow.graph.tensor_parallel.tensor_plan import (
    Region,
    TensorParallelError,  # noqa: F401 - raised by plan_tensor_parallel_split; callers import it from here
    TensorParallelPlan,
    check_rewrites_private,
    check_sizes,
    describe,
    log_plan,
)
from ortflow.graph.tensor_parallel.tensor_shapes import DimOf, shape_entry, static_ints, tensor_dims, weight_of
from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_vocab import plan_vocab

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Erf", "Tanh", "Relu", "Gelu", "Sigmoid", "Identity", "Sqrt",
                "Neg", "Exp", "Log", "Cast", "Where", "FastGelu", "Abs", "Reciprocal", "LeakyRelu", "Elu",
                "CastLike"}


def _attr(node, name, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


class _Walk:
    """One pass over the graph in order, propagating 'split on axis k' (k < 0, counted from the end) from seeds."""

    def __init__(self, model, trainable: set[str], seeds: set[int], size: int, dims: tuple[dict, dict],
                 products: dict[int, set[int]] | None = None):
        self.g, self.trainable, self.size, self.products = model.graph, trainable, size, products or {}
        self.shapes, self.named = dims
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
        self.parts = FusedParts()  # the parts of fused projections
        self.bias_of: dict[str, int] = {}  # tensor after the seed's bias add -> seed node
        self.part_of: dict[str, int] = {}  # a part of a fused projection (q, k or v) -> seed node
        self.rewrites: list[tuple[int, int, int, int, int]] = []  # (+ component)
        self.via_transpose: set[str] = set()  # weights read as Transpose(W) (torch's nn.Linear on 3-D inputs)
        self.head_counts: list[tuple[int, int]] = []  # (Reshape node, size of the split axis it makes) for heads
        self.seed_heads: dict[int, int] = {}  # seed node -> heads its output is reshaped into
        self.shape_of: dict[str, int] = {}  # Shape of a split tensor -> the split axis (its length follows by itself)
        self.slices: list[tuple[int, int, int, int, int]] = []  # replicated keys/values each rank slices (+ component)
        for i, node in enumerate(self.g.node):
            if i in seeds:
                self.split[node.output[0]], self.comp[node.output[0]] = -1, i
                self.node_comp[i] = i
                self.bias_of[node.output[0]] = i
                continue
            self._visit(i, node)
        self.outputs = {o.name for o in self.g.output}
        for seed in self.parts.bounds:
            why = self.parts.cover(seed, self._dim(self.g.node[seed].output[0], -1))
            if why:
                self.fail(seed, why)
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
        if not ins and node.op_type == "Expand" and node.input[1] in self.shape_of:
            ins = [node.input[1]]  # a replicated tensor broadcast to a split tensor's shape
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
            if out in self.split or out in self.shape_of:
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
            at = self.split.get(a, 0)
            if i in self.products and b not in self.split and at <= -3 and self._dim(b, at) == self._dim(a, at):
                # replicated keys or values (tensor_kv): each rank reads its query heads' block of their head axis
                self.slices.append((i, 1, at, self._dim(a, at), self.find(self.comp[a])))
                self.split[node.output[0]] = at
                return None
            return "its inputs are not split the same way over a batch axis"
        if op == "Shape":
            if _attr(node, "start", 0) == 0 and _attr(node, "end") is None:
                self.shape_of[node.output[0]] = axis
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
        if op == "Expand":
            return self._expand(i, node, axis)
        if op == "Slice" and self.bias_of.get(x) is not None and not keeps_axis(self.g, self.shapes, self.producers,
                                                                                 node, axis):
            return self._part(i, node, axis)
        if op in ("Unsqueeze", "Squeeze", "Slice", "Concat"):
            return self._move(node, axis)
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
        rewrites = split_parts(self.g, self.shapes, i, axis) if seed is not None else None
        if not isinstance(rewrites, list):
            return rewrites or "a Split of a split activation other than a projection's output, along its columns"
        self.parts.groups[seed] = len(node.output)
        self.rewrites += [(*w, seed) for w in rewrites]
        for out in node.output:
            self.split[out] = axis
            self.part_of[out] = seed
        return None

    def _part(self, i: int, node, axis: int) -> str | None:
        """A Slice of a fused projection's output along its columns: one part (:func:`slice_part`)."""
        x = node.input[0]
        part = slice_part(self.g, self.shapes, self.producers, self.split, i, axis, self.size)
        if part is None:
            return self._move(node, axis)
        if isinstance(part, str):
            return part
        start, end, rewrites = part
        self.rewrites += [(*w, self.find(self.comp[x])) for w in rewrites]
        self.parts.add(self.bias_of[x], node.output[0], start, end)
        self.split[node.output[0]] = axis
        self.part_of[node.output[0]] = self.bias_of[x]
        return None

    def _reshape(self, i: int, node, axis: int) -> str | None:
        x, out = node.input[0], node.output[0]
        s_in, s_out = self.named.get(x), self.named.get(out)
        if s_in is None or s_out is None:
            return "shapes around the Reshape are not known (export with fixed sizes)"
        b = reshape_axis(s_in, s_out, len(s_in) + axis)
        if isinstance(b, str):
            return b
        why = self._entry(i, b, s_out[b], self.find(self.comp[x]), copies=len(s_in) + axis)
        if why:
            return why
        self.split[out] = b - len(s_out)
        if b < len(s_out) - 1 and isinstance(s_out[b], int):  # a head axis: each rank needs whole heads
            self.head_counts.append((i, s_out[b]))
            seed = self.bias_of.get(x, self.part_of.get(x))  # the projection's output, or a part of a fused one
            if seed is not None:
                self.seed_heads.setdefault(seed, s_out[b])
                self.parts.note_heads(seed, x, s_out[b])
        if x in self.bias_of and axis == -1 and b == len(s_out) - 1:  # [B*T, 3D] -> [B, T, 3D] before a fused Split
            self.bias_of[out] = self.bias_of[x]
        return None

    def _entry(self, i: int, element: int, full, root: int, copies: int | None = None) -> str | None:
        """Check the entry of node ``i``'s shape input that sets the split axis's size (``full`` on the whole
        model), and record the rewrite of the constant holding it: a tensor's runtime size follows the local size
        by itself when that tensor is split on that axis; -1 (Reshape) and 1 (Expand) need nothing."""
        spec = shape_entry(self.g, self.shapes, self.producers, i, 1, element)
        if isinstance(spec, DimOf):
            t = spec.tensor
            if t in self.split and self._rank(t) + self.split[t] == spec.axis:
                return None
            return f"the new shape's split entry is the size of axis {spec.axis} of '{t}', which is not split there"
        if isinstance(spec, str):
            return spec
        value, scale = spec[3], spec[4]
        if value == -1 or (value == 1 and copies is None):
            return None
        if value == 0:
            return None if copies == element else "the new shape copies (0) the split axis from another position"
        if isinstance(full, int) and value * scale != full:
            return f"the new shape's split entry {value * scale:g} is not the split axis's size {full}"
        self.rewrites.append((*spec[:4], root))
        return None

    def _expand(self, i: int, node, axis: int) -> str | None:
        """An Expand that broadcasts other axes than the split one (``repeat_kv``: ``[B, KV, 1, T, D]`` to
        ``[B, KV, n_rep, T, D]``; the engine's Where gradient fix: to the shape of a tensor split alike)."""
        x = node.input[0]
        target = self.shapes.get(node.input[1])
        if x not in self.split:  # to the shape of a split tensor: split alike where x is broadcast
            at, rank = self.shape_of[node.input[1]], self._rank(x)
            if rank is None or (-at <= rank and self._dim(x, at) != 1):
                return f"'{x}' is expanded to a split tensor's shape but is not broadcast along the split axis"
            self.split[node.output[0]] = at
            return None
        if not target or target[0] is None:
            return "an Expand to a shape of unknown length"
        if target[0] + axis >= 0:
            why = self._entry(i, target[0] + axis, self._dim(x, axis), self.find(self.comp[x]))
            if why:
                return why
        self.split[node.output[0]] = axis
        return None

    def _move(self, node, axis: int) -> str | None:
        """Unsqueeze, Squeeze, Slice and Concat (:func:`ortflow.graph.tensor_parallel.tensor_axes.moved_axis`)."""
        x = node.input[0]
        rank = self._rank(x)
        if rank is None:
            return "unknown rank"
        if node.op_type == "Concat" and any(y not in self.split or self.split[y] != axis for y in node.input):
            return "a Concat of a split tensor with one not split alike"
        static = [static_ints(self.g, self.producers, y) if y else None for y in node.input[1:]]
        moved = moved_axis(node, rank, rank + axis, static, self._dim(x, axis))
        if isinstance(moved, str):
            return moved
        self.split[node.output[0]] = moved
        return None


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


def plan_tensor_parallel_split(model: onnx.ModelProto, trainable: list[str] | set[str], size: int,
                               embedded: frozenset[str] = frozenset(), unsplit: bool = False) -> TensorParallelPlan:
    """Find the regions to split over ``size`` ranks (pure; nothing is changed). ``embedded``: tables the whole model
    splits by vocabulary, when ``model`` is one pipeline stage of it (the last stage's LM head, whose embedding is in
    the first stage; an LM head tied to another stage's embedding).
    ``unsplit``: a plan with no region is returned (a pipeline stage its tensor-parallel ranks run whole) rather than
    refused.

    Raises:
        TensorParallelError: ``size`` does not divide a split width or head count (names them and the fix), or no
            region was found (without ``unsplit``).
    """
    trainable = set(trainable)
    dims = tensor_dims(model)
    candidates = _candidates(model.graph, trainable, dims[0])
    kv, products = replicated_kv(model.graph, dims[0], set(candidates), size)
    seeds, kept = set(candidates) - set(kv), {}
    for n in model.graph.node:  # a layer the pass could split once its bias is taken out (configure does)
        if n.op_type == "Gemm" and not is_plain_gemm(n) and n.input[1] in trainable:
            kept[n.input[1]] = "a Gemm with transA, alpha or a bias input (separate_gemm_biases takes biases out first)"
    while True:
        walk = _Walk(model, trainable, seeds, size, dims, products)
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
    regions = _regions(model.graph, walk, seeds, candidates, kv, products)
    for r in walk.rows.values():
        kept.pop(r, None)
    read = {w for r in regions for w in r.replicated_kv}
    kept.update({candidates[s]: f"key/value heads {tp_note(kv[s], size)}, and no split attention reads them"
                 for s in kv if candidates[s] not in read})
    split_so_far = set(TensorParallelPlan(size, regions, [], {}).slicing())
    regions += plan_vocab(model, trainable, size, walk.shapes, split_so_far, kept, embedded)
    plan = TensorParallelPlan(size, regions, [w[:4] for w in walk.rewrites], kept,
                              [x[:4] for x in walk.slices if walk.find(x[4]) not in walk.failed])
    check_sizes(model, plan, walk.shapes, walk.head_counts, unsplit)
    check_rewrites_private(model, plan, walk.readers)
    return plan


def _regions(graph, walk: _Walk, seeds: set[int], candidates: dict[int, str],
             kv: dict[int, tuple[int, int]], products: dict[int, set[int]]) -> list[Region]:
    by_root: dict[int, Region] = {}
    for s in sorted(seeds):
        r = by_root.setdefault(walk.find(s), Region())
        r.columns.append(candidates[s])
        if transposed(graph.node[s]) or graph.node[s].input[1] != candidates[s]:  # Gemm transB=1, or Transpose(W)
            r.transposed.append(candidates[s])
        if graph.node[s].input[1] != candidates[s]:
            r.nodes.append(walk.producers[graph.node[s].input[1]])
        if s in walk.seed_heads:
            r.num_heads[candidates[s]] = walk.seed_heads[s]
        walk.parts.mark(r, s, candidates[s])
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
            walk.parts.mark(r, walk.bias_of[graph.node[i].output[0]], walk.biases[i], bias=True)
    for i, _, _, _, c in walk.slices:  # the replicated key/value projections whose heads the product reads
        by_root[walk.find(c)].replicated_kv.update({candidates[s]: kv[s] for s in sorted(products[i])})
    for r in by_root.values():
        r.nodes.sort()
    return [by_root[k] for k in sorted(by_root)]


def split_for_rank(model: onnx.ModelProto, trainable, size: int, rank: int,
                   report: list[dict] | None = None) -> tuple[onnx.ModelProto, TensorParallelPlan]:
    """Plan (logging what it split and kept) and shard for ``rank``: the pass of configure."""
    plan = plan_tensor_parallel_split(model, trainable, size)
    lines = describe(plan)
    if rank == 0:
        log_plan(plan)
        if report is not None:
            report.append({"pass": "tensor_parallel", "changes": lines})
    return shard_model(model, plan, rank), plan
