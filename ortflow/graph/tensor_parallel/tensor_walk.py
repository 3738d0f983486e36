"""The tensor-parallel split's walk: one pass over the graph in order, propagating "split on axis k" from the
column-split projections (seeds) through the ops the split follows (:mod:`ortflow.graph.tensor_parallel.tensor_split`
lists them) to the row-split products that end a region, with what each rank's piece needs on the way: the constants
to rewrite for the local sizes, the head counts, the parts of fused projections
(:mod:`ortflow.graph.tensor_parallel.tensor_fused`), the replicated keys and values each rank slices
(:mod:`ortflow.graph.tensor_parallel.tensor_kv`), the biases with a head axis added to the scores
(:mod:`ortflow.graph.tensor_parallel.tensor_bias`); and, for a seed whose activation meets what the split cannot
follow, the reason.
"""

from __future__ import annotations

from ortflow.graph.onnx_tools import attribute, node_label
from ortflow.graph.tensor_parallel.tensor_axes import moved_axis
from ortflow.graph.tensor_parallel.tensor_bias import BiasPaths, parameter_free
from ortflow.graph.tensor_parallel.tensor_fused import FusedParts, keeps_axis, slice_part, split_parts
from ortflow.graph.tensor_parallel.tensor_gemm import is_plain_gemm
from ortflow.graph.tensor_parallel.tensor_merged import batch_entries, merged_reshape
from ortflow.graph.tensor_parallel.tensor_shapes import DimOf, shape_entry, static_ints, weight_of

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Erf", "Tanh", "Relu", "Gelu", "Sigmoid", "Identity", "Sqrt",
                "Neg", "Exp", "Log", "Cast", "Where", "FastGelu", "Abs", "Reciprocal", "LeakyRelu", "Elu",
                "CastLike"}


class SplitWalk:
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
        self.bias = BiasPaths(self.g, trainable, self.shapes, self.producers, self.readers,
                              {x.name for x in self.g.input})
        self.bias_reads: list[tuple[int, str, int]] = []  # (Add of the scores, bias path tensor it reads, component)
        self.free: dict[str, bool] = {}  # tensor -> no trained parameter among its ancestors
        self.split: dict[str, int] = {}  # tensor -> split axis (negative)
        self.merged: dict[str, int] = {}  # tensor (or its Shape) split on heads merged with the batch -> the heads
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
        merged = {self.merged.get(x) for x in ins}
        why = (self._propagate(i, node) if len(merged) == 1 else
               "its inputs are split on the heads in one and on the heads merged with the batch in another")
        if why:
            self.fail(root, f"{node.op_type} '{node_label(node)}': {why}")
            return
        for out in node.output:
            if out in self.split or out in self.shape_of:
                self.comp[out] = root
                if None not in merged and node.op_type != "Reshape":  # the merged axis carried (tensor_merged)
                    self.merged[out] = next(iter(merged))

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
            weight = (weight_of(self.g, b, self.trainable, self.producers, self.readers)
                      if a in self.split and b not in self.split else None)
            if weight is not None and self._rank(weight[0]) == 2:
                if self.split[a] != -1 or a in self.merged:
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
            if (i in self.products and b not in self.split and at <= -3 and self._dim(b, at) == self._dim(a, at)
                    and a not in self.merged):
                # replicated keys or values (tensor_kv): each rank reads its query heads' block of their head axis
                self.slices.append((i, 1, at, self._dim(a, at), self.find(self.comp[a])))
                self.split[node.output[0]] = at
                return None
            return "its inputs are not split the same way over a batch axis"
        if op == "Shape":
            if attribute(node, "start", 0) == 0 and attribute(node, "end") is None:
                self.shape_of[node.output[0]] = axis
            return None
        if op == "Transpose":
            rank = self._rank(x)
            if rank is None:
                return "unknown rank"
            perm = attribute(node, "perm") or list(range(rank))[::-1]
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
            if rank is None or (attribute(node, "axis", -1) % rank) == rank + axis:
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
            if dim is not None and dim != 1 and not self._head_bias(i, node, x, axis, dim):
                if x in self.bias.axis:
                    return (f"'{x}' (the bias from '{self.bias.table[x]}') does not have its heads on the split axis"
                            if self.bias.axis[x] != axis else
                            f"'{x}' (the bias from '{self.bias.table[x]}') is not added to scores split by heads")
                return f"'{x}' is not broadcast along the split axis"
        self.split[node.output[0]] = axis
        return None

    def _head_bias(self, i: int, node, x: str, axis: int, dim: int) -> bool:
        """Whether ``x``, as long as the split axis, is a bias added to scores split by heads that each rank reads its
        heads' block of (:mod:`ortflow.graph.tensor_parallel.tensor_bias`): computed from a relative position bias
        table (the rank computes it from its columns), or from no trained parameter (the rank slices it)."""
        split = [y for y in node.input if y in self.split]
        if node.op_type != "Add" or dim != self._dim(split[0], axis) or any(y in self.merged for y in split):
            return False
        root = self.find(self.comp[split[0]])
        if x in self.bias.axis:
            if self.bias.axis[x] != axis:
                return False
            self.bias_reads.append((i, x, root))
            return True
        if not parameter_free(self.g, self.trainable, self.producers, x, self.free):
            return False
        self.slices.append((i, list(node.input).index(x), axis, dim, root))
        return True

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
        found = merged_reshape(s_in, s_out, len(s_in) + axis, self.merged.get(x))
        if isinstance(found, str):
            return found
        b, inner, batch = found
        why = (self._entry(i, b, s_out[b], self.find(self.comp[x]), copies=len(s_in) + axis, merged=inner)
               or batch_entries(self.g, self.shapes, self.producers, self.split, i, batch, len(s_in) + axis))
        if why:
            return why
        self.split[out] = b - len(s_out)
        if inner is not None:
            self.merged[out] = inner
        elif b < len(s_out) - 1 and isinstance(s_out[b], int):  # a head axis: each rank needs whole heads
            self.head_counts.append((i, s_out[b]))
            seed = self.bias_of.get(x, self.part_of.get(x))  # the projection's output, or a part of a fused one
            if seed is not None:
                self.seed_heads.setdefault(seed, s_out[b])
                self.parts.note_heads(seed, x, s_out[b])
        if x in self.bias_of and axis == -1 and b == len(s_out) - 1:  # [B*T, 3D] -> [B, T, 3D] before a fused Split
            self.bias_of[out] = self.bias_of[x]
        return None

    def _entry(self, i: int, element: int, full, root: int, copies: int | None = None,
               merged: int | None = None) -> str | None:
        """Check the entry of node ``i``'s shape input that sets the split axis's size (``full`` on the whole
        model), and record the rewrite of the constant holding it: a tensor's runtime size follows the local size
        by itself when that tensor is split on that axis, merged with the batch where the new axis is (``merged``:
        its head count, :mod:`ortflow.graph.tensor_parallel.tensor_merged`); -1 (Reshape) and 1 (Expand) need
        nothing."""
        spec = shape_entry(self.g, self.shapes, self.producers, i, 1, element)
        if isinstance(spec, DimOf):
            t = spec.tensor
            if t in self.split and self._rank(t) + self.split[t] == spec.axis:
                if self.merged.get(t) != merged:
                    return (f"the new shape's split entry is the size of axis {spec.axis} of '{t}', "
                            + ("the heads merged with the batch" if merged is None else "not merged with the batch"))
                math, size = spec.arithmetic, self._dim(t, self.split[t])
                if math.plain or (size is not None and math.follows(size, self.size)):
                    return None
                return f"the new shape's split entry is {math.formula()} of the size D of a split axis, not its share"
            return f"the new shape's split entry is the size of axis {spec.axis} of '{t}', which is not split there"
        if isinstance(spec, str):
            return spec
        value, math = spec[3], spec[4]
        if math.plain and (value == -1 or (value == 1 and copies is None)):
            return None
        if math.plain and value == 0:
            return None if copies == element else "the new shape copies (0) the split axis from another position"
        entry = value * math.scale if math.plain else math.of(value)
        if isinstance(full, int) and entry != full:
            return f"the new shape's split entry {entry:g} is not the split axis's size {full}"
        if not math.follows(value, self.size):
            return f"the new shape's split entry is {math.formula()} of a constant D = {value}, not its share"
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
            why = self._entry(i, target[0] + axis, self._dim(x, axis), self.find(self.comp[x]),
                              merged=self.merged.get(x))
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
