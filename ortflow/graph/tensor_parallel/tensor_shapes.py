"""What the tensor-parallel split reads off a graph's shape arithmetic: every tensor's dims, which constant holds an
entry of a computed shape (so a head count or a width can be rewritten for the local size) or which tensor's runtime
size it is (so it follows the local size by itself), small integer constants however an exporter writes them, and
which trained weight a MatMul reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from ortflow.graph.onnx_tools import attribute, constant_values, infer_shapes
from ortflow.graph.shapes import symbolic_shapes

_CANNOT = "the new shape is computed in a way the split cannot follow"


# The size every dynamic dim of the inputs gets in each of two probes: a prime no model width is, so a dim (or a product
# of dims) computed from it is recognisable, and differs between the two probes exactly when it depends on it. One size
# for all dynamic dims: the inputs of a pipeline stage name the batch and sequence differently from the model's inputs
# (a received activation's dims are named by shape inference), and the shape arithmetic reads them from either.
_PROBES = (10007, 10009)


def probe_sizes(model: onnx.ModelProto) -> tuple[int, int]:
    """The two probe sizes (:data:`_PROBES`), or, where the graph clamps a size with ``Min(c, size)``, the two largest
    primes below the smallest such ``c``: torch's dynamo exporter writes GPT-2's ``min(n_positions, T)`` (the causal
    mask buffer sliced to the sequence), and a probe longer than the model accepts builds shapes that do not fit
    (``[B*T, C]`` reshaped to ``[B, n_positions, C]``), where inference stops and the dims are lost."""
    bounds = []
    for node in model.graph.node:
        if node.op_type == "Min":
            values = [constant_values(model.graph, x) for x in node.input]
            bounds += [int(v.reshape(-1).min()) for v in values if v is not None and v.size and v.dtype.kind in "iu"]
    if not bounds or min(bounds) > _PROBES[1]:
        return _PROBES
    primes = [n for n in range(min(bounds) - 1, 4, -1) if all(n % d for d in range(2, int(n**0.5) + 1))][:2]
    return (primes[1], primes[0]) if len(primes) == 2 else _PROBES


def tensor_dims(model: onnx.ModelProto) -> tuple[dict[str, list], dict[str, list]]:
    """Every tensor's dims: (ints, None where not a fixed number), and (ints or names, None where unknown).

    The model is inferred with its inputs' dynamic dims set to one size, twice (:func:`probe_sizes`): a dim that
    differs between the two follows the inputs (None in the first dict; in the second the first probe's number, so a
    Reshape's ``[B*T, C] -> [B, T, C]`` still shows which dims it merges). Inference with concrete inputs follows the
    shape arithmetic of exporters (Shape -> Gather -> Concat -> Reshape; ``Shape`` ranges) where symbolic dims get
    lost; where it still stops, the output dims of a Reshape or Expand are read off its shape input
    (:func:`target_dims`) and inference goes on from there. Without an answer from the probes, ONNX Runtime's
    symbolic inference and onnx's (with data propagation) fill in the dims, dynamic ones named.
    """
    sizes = probe_sizes(model)
    first, second = _probe(model, sizes[0]), _probe(model, sizes[1])
    named = _symbolic_dims(model)
    for name, dims in first.items():
        other = second.get(name)
        if other is not None and len(other) == len(dims) and None not in dims:
            named[name] = dims
    for t in model.graph.initializer:
        named[t.name] = list(t.dims)
    fixed = {}
    for name, dims in named.items():
        other = second.get(name)
        same = other is not None and len(other) == len(dims)
        fixed[name] = [d if isinstance(d, int) and (not same or other[k] == d) else None for k, d in enumerate(dims)]
    return fixed, named


def _probe(model: onnx.ModelProto, size: int) -> dict[str, list]:
    """Every tensor's dims (ints, None where unknown) with the inputs' dynamic dims all set to ``size``."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    inits = {t.name for t in probe.graph.initializer}
    for value in probe.graph.input:
        if value.name not in inits:
            for dim in value.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value"):
                    dim.dim_value = size
    producers = {o: k for k, n in enumerate(probe.graph.node) for o in n.output}
    for _ in range(4):  # shapes read off Reshape and Expand shape inputs where inference stopped, then again
        dims = {k: [d if isinstance(d, int) else None for d in v] for k, v in _symbolic_dims(probe).items()}
        found = {}
        for k, node in enumerate(probe.graph.node):
            out, known = node.output[0] if node.output else "", dims.get(node.output[0] if node.output else "")
            if node.op_type in ("Reshape", "Expand") and (known is None or None in known) and dims.get(node.input[0]):
                computed = target_dims(probe.graph, dims, dims, producers, k, dims[node.input[0]])
                if computed and all(isinstance(d, int) and d > 0 for d in computed):
                    found[out] = computed
        if not found:
            return dims
        for info in [v for v in probe.graph.value_info if v.name in found]:
            probe.graph.value_info.remove(info)
        inferred = infer_shapes(probe).graph.value_info
        types = {v.name: v.type.tensor_type.elem_type for v in inferred}
        probe.graph.value_info.extend(helper.make_tensor_value_info(name, types.get(name, onnx.TensorProto.FLOAT), d)
                                      for name, d in found.items())
    return dims


def _symbolic_dims(model: onnx.ModelProto) -> dict[str, list]:
    """ONNX Runtime's symbolic inference and onnx's (with data propagation), each dim a number where either knows it."""
    try:
        inferred = infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - onnx raises several kinds; symbolic inference may still answer
        inferred = model
    g = inferred.graph
    named: dict[str, list] = {}
    for vi in [*g.value_info, *g.input, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape"):
            named[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    for name, dims in (symbolic_shapes(model) or {}).items():  # a fixed number from either inference wins
        mine = named.get(name)
        if mine is None or len(mine) != len(dims):
            named[name] = dims
        else:
            named[name] = [d if isinstance(d, int) or not isinstance(m, int) else m
                           for d, m in zip(dims, mine, strict=True)]
    return named


@dataclass(frozen=True)
class Arithmetic:
    """What a computed shape entry does to the size (or constant) it is computed from, in the order the graph does it:
    ``("Mul", c)``, ``("Div", c)`` (an integer Div rounds down) or ``("Add", c)`` steps."""

    steps: tuple[tuple[str, float], ...] = ()

    @property
    def scale(self) -> float:
        """The factor the Mul and Div steps multiply the size by."""
        scale = 1.0
        for op, c in reversed(self.steps):
            scale = scale * c if op == "Mul" else (scale / c if op == "Div" else scale)
        return scale

    @property
    def plain(self) -> bool:
        """Whether the entry is the size times a factor (no offset)."""
        return all(op != "Add" for op, _ in self.steps)

    def of(self, size: int) -> int:
        """The entry for a size: the size times :attr:`scale`, or with an offset as the graph computes it."""
        if self.plain:
            return int(round(size * self.scale))
        value: float = size
        for op, c in self.steps:
            if op == "Add":
                value += c
            elif op == "Mul":
                value *= c
            else:
                value = value // c if float(value).is_integer() and float(c).is_integer() else value / c
        return int(round(value))

    def follows(self, full: int, size: int) -> bool:
        """Whether the entry computed on each of ``size`` ranks' local size ``full / size`` is its share of the entry
        on ``full``: always for multiples of the size (a size that does not divide is refused elsewhere); with an
        offset a division rounds away (TorchScript's ``chunk`` bound ``(D + 1) / 2``) only where it rounds it away on
        both sizes."""
        return self.plain or full % size == 0 and self.of(full // size) * size == self.of(full)

    def formula(self) -> str:
        """The arithmetic on a size ``D``, written out (``(D + 1) / 2``)."""
        text = "D"
        for op, c in self.steps:
            if not (op in ("Mul", "Div") and c == 1):
                text = f"({text} {dict(Add='+', Mul='*', Div='/')[op]} {c:g})"
        return text[1:-1] if text.startswith("(") else text


@dataclass(frozen=True)
class DimOf:
    """A computed shape entry that is the runtime size of axis ``axis`` (>= 0) of ``tensor``, possibly with arithmetic
    on it: on each rank it is computed from that tensor's local size, so it needs no rewriting when the axis is split
    and the arithmetic gives the rank's share (:meth:`Arithmetic.follows`)."""

    tensor: str
    axis: int
    arithmetic: Arithmetic = Arithmetic()


def static_ints(graph: onnx.GraphProto, producers: dict[str, int], name: str, depth: int = 0) -> np.ndarray | None:
    """The value of a small integer tensor computed from constants only (a Constant or initializer, through the Cast,
    Reshape, Unsqueeze, Squeeze, Identity and Concat the exporters wrap them in), else None."""
    values = constant_values(graph, name, producers)
    if values is not None or depth > 8 or name not in producers:
        return values
    node = graph.node[producers[name]]
    inputs = [static_ints(graph, producers, x, depth + 1) if x else None for x in node.input]
    if not inputs or inputs[0] is None:
        return None
    if node.op_type in ("Cast", "Identity"):
        return inputs[0]
    if node.op_type in ("Reshape", "Unsqueeze", "Squeeze"):
        return inputs[0].reshape(-1) if inputs[0].size != 1 or node.op_type != "Squeeze" else inputs[0].reshape(())
    if node.op_type == "Concat" and all(v is not None for v in inputs):
        return np.concatenate([v.reshape(-1) for v in inputs])
    return None


def shape_entry(graph: onnx.GraphProto, shapes: dict[str, list], producers: dict[str, int], reader: int, pos: int,
                element: int, depth: int = 0, steps: tuple = ()):
    """Where element ``element`` of input ``pos`` of node ``reader`` comes from, followed back through the shape
    arithmetic exports write (Concat, Unsqueeze, Squeeze, Reshape, Gather and Slice of 1-D int tensors, Cast, a
    product, quotient or sum with a constant, torch's ``expand`` rule ``Where(s == -1, 1, s)``) to a constant or a
    ``Shape``.

    Returns:
        (the node reading the constant, its input, the element, the value, the :class:`Arithmetic` on it) for a
        constant; :class:`DimOf` for a tensor's runtime size; a string saying why the split cannot follow
        it otherwise.

    Args:
        graph: The graph.
        shapes: Every tensor's dims (None where not fixed).
        producers: Tensor name -> index of the node that makes it.
        reader: The node reading the shape (a Reshape, or a node on the way back).
        pos: Which of its inputs.
        element: Which element of that input (flat).
        depth: How many nodes were followed back so far.
        steps: The arithmetic followed so far, in the order the graph computes it (:attr:`Arithmetic.steps`).
    """
    name = graph.node[reader].input[pos]
    values = constant_values(graph, name, producers)
    if values is not None:
        flat = values.reshape(-1)
        if element >= flat.size:
            return _CANNOT
        return reader, pos, element, int(flat[element]), Arithmetic(steps)
    producer = producers.get(name)
    if producer is None or depth > 16:
        return "the new shape's split entry is computed, not a Constant"
    node = graph.node[producer]
    follow = _followed_input(graph, shapes, producers, node, element)
    if isinstance(follow, str):
        return follow
    if isinstance(follow, DimOf):
        return DimOf(follow.tensor, follow.axis, Arithmetic(steps))
    k, at = follow
    if node.op_type in ("Mul", "Div", "Add"):
        constant = static_ints(graph, producers, node.input[1 - k]).reshape(-1)[0].item()
        steps = ((node.op_type, constant), *steps)
    return shape_entry(graph, shapes, producers, producer, k, at, depth + 1, steps)


def _followed_input(graph, shapes, producers, node: onnx.NodeProto, element: int):
    """Which input (and element of it) holds ``element`` of ``node``'s output; a DimOf for a Shape; or why not."""
    op = node.op_type
    if op == "Shape":
        rank = len(shapes.get(node.input[0]) or [])
        start = attribute(node, "start", 0)
        return DimOf(node.input[0], (start + rank if start < 0 else start) + element)
    if op in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
        return 0, element
    if op == "Reshape" and len(shapes.get(node.input[0]) or [1]) <= 1:  # a scalar or 1-D int tensor made 1-D
        return 0, element
    if op == "Where" and _made_by(graph, producers, node.input[1]) == "ConstantOfShape":
        return 2, element  # torch's expand: -1 entries become 1, the others are the shape's own
    if op in ("Mul", "Div", "Add"):  # a size times (over, plus) a constant: DimOf.follows says where it follows
        for k in ((0,) if op == "Div" else (0, 1)):
            other = node.input[1 - k]
            if static_ints(graph, producers, other) is not None:
                dims = shapes.get(node.input[k])
                return k, (element if dims and dims[0] not in (None, 1) else 0)
        return _CANNOT if op != "Add" else "the new shape's split entry is computed, not a Constant"
    if op == "Concat":
        at = 0
        for k, part in enumerate(node.input):
            dims = shapes.get(part)
            if dims is None or None in dims:  # a constant part shape inference left untyped (behind an Identity)
                value = static_ints(graph, producers, part)
                dims = None if value is None else list(value.shape)
            if dims is None or len(dims) > 1 or None in dims:
                return _CANNOT
            length = dims[0] if dims else 1
            if at <= element < at + length:
                return k, element - at
            at += length
        return _CANNOT
    if op in ("Gather", "Slice"):
        index = _index_in(graph, shapes, producers, node, element)
        return index if isinstance(index, str) else (0, index)
    return "the new shape's split entry is computed, not a Constant"


def _made_by(graph: onnx.GraphProto, producers: dict[str, int], name: str) -> str | None:
    return graph.node[producers[name]].op_type if name in producers else None


def _index_in(graph: onnx.GraphProto, shapes: dict[str, list], producers: dict[str, int], node: onnx.NodeProto,
              element: int) -> int | str:
    """For a Gather (axis 0, constant index) or Slice (constant start, axis 0, step 1) of a 1-D tensor: which element
    of its input its ``element`` is."""
    dims = shapes.get(node.input[0])
    if dims is None or len(dims) != 1 or dims[0] is None:
        return _CANNOT
    length = dims[0]
    if node.op_type == "Gather":
        index = constant_values(graph, node.input[1], producers)
        if index is None or index.size != 1 or attribute(node, "axis", 0) != 0:
            return _CANNOT
        return int(index.reshape(-1)[0]) % length
    start, _, axes, steps = [constant_values(graph, x, producers) if x else None
                             for x in [*node.input[1:5], "", "", ""][:4]]
    if (start is None or start.size != 1 or (axes is not None and axes.reshape(-1).tolist() not in ([0], [-1]))
            or (steps is not None and steps.reshape(-1).tolist() != [1])):
        return _CANNOT
    first = int(start.reshape(-1)[0])  # clamped to the tensor as Slice does (torch writes INT64_MIN for "from 0")
    return min(max(first + length if first < 0 else first, 0), length) + element


def weight_of(graph: onnx.GraphProto, name: str, trainable: set[str], producers: dict[str, int],
              readers: dict[str, list[int]]) -> tuple[str, bool] | None:
    """The trained 2-D weight a MatMul reads as ``name``: the initializer itself, or (torch's ``nn.Linear`` on 3-D
    inputs) ``Transpose(W)`` of a ``[out, in]`` weight ``W`` whose only reader is that Transpose, read once; with
    whether it is read transposed. None otherwise. ``producers``: tensor -> the node making it; ``readers``: tensor ->
    the nodes reading it."""
    if name in trainable:
        return name, False
    maker = graph.node[producers[name]] if name in producers else None
    if maker is None or maker.op_type != "Transpose" or maker.input[0] not in trainable:
        return None
    perm = next((list(a.ints) for a in maker.attribute if a.name == "perm"), [1, 0])
    if perm != [1, 0] or len({*readers.get(name, []), *readers.get(maker.input[0], [])}) != 2:
        return None
    return maker.input[0], True


def target_dims(graph: onnx.GraphProto, shapes: dict[str, list], named: dict[str, list], producers: dict[str, int],
                reader: int, dims_in: list) -> list | None:
    """The output dims of a Reshape or Expand (node ``reader``, input dims ``dims_in``) read off its shape input
    (constants, sizes of other tensors, Reshape's 0 and -1, Expand's broadcast), where shape inference lost them; None
    when the shape's length is unknown. A dim that cannot be told is None."""
    node = graph.node[reader]
    length = (shapes.get(node.input[1]) or [None])[0]
    if length is None:
        return None
    out: list = []
    for e in range(length):
        spec = shape_entry(graph, shapes, producers, reader, 1, e)
        if isinstance(spec, DimOf):
            dims = named.get(spec.tensor) or []
            d = dims[spec.axis] if spec.axis < len(dims) else None
            math = spec.arithmetic
            out.append(math.of(d) if isinstance(d, int) else (d if math.plain and math.scale == 1 else None))
        else:
            out.append(spec[4].of(spec[3]) if isinstance(spec, tuple) else None)
    if node.op_type == "Expand":
        pad = [1] * (len(out) - len(dims_in)) + list(dims_in)
        return [b if t == 1 else (t if t is not None or b == 1 else None) for t, b in
                zip([1] * (len(pad) - len(out)) + out, pad, strict=True)]
    out = [dims_in[k] if d == 0 and k < len(dims_in) else d for k, d in enumerate(out)]
    if out.count(-1) == 1:
        out[out.index(-1)] = _remaining(list(dims_in), [d for d in out if d != -1])
    return out


def _remaining(dims_in: list, others: list):
    """The size a Reshape's -1 stands for: the input's dims with the others divided out (named dims cancel)."""
    if None in dims_in or None in others:
        return None
    names_in = [d for d in dims_in if isinstance(d, str)]
    for d in others:
        if isinstance(d, str):
            if d not in names_in:
                return None
            names_in.remove(d)
    total = int(np.prod([d for d in dims_in if isinstance(d, int)]))
    rest = int(np.prod([d for d in others if isinstance(d, int)]))
    if names_in or rest == 0 or total % rest:
        return names_in[0] if len(names_in) == 1 and total == rest else None
    return total // rest
