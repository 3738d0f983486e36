"""The training graph cut for CUDA graph capture: a head the CUDA provider records once and replays, and a tail of
the nodes it cannot record, run as ordinary engine calls after it.

The CUDA provider replays a recorded graph of kernel launches instead of launching each kernel from the host (its
``enable_cuda_graph`` option), which is what a launch-bound training step needs. A node can be recorded only if its
kernel never waits for the device inside the step: ``GatherGrad`` (the embedding's gradient) copies its segment count
to the host to size its work, and nodes whose output shape depends on the data do the same. Those nodes and every
node downstream of them form the tail; the tensors the tail reads from the head become the head's outputs (written
into buffers bound once) and the tail's inputs. Cheap shape computations the tail needs (``Shape`` of a tensor and
integer arithmetic on it) are copied into the tail instead of crossing, since the head computes them on the host,
where a replay does not run them. A head node whose results only the tail reads moves to the tail, so the engine
fuses the same pairs of nodes as in the unsplit graph (a fused pair rounds once, a split one twice: in fp16 the
embedding's gradient would not keep its bits).

A graph with random operators is not cut: a replay repeats the recorded random draws (every update would reuse one
dropout mask), so such a model trains without capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

#: Ops whose CUDA kernels wait for the device inside a call (they cannot be recorded into a CUDA graph).
UNCAPTURABLE = frozenset({"GatherGrad", "NonZero", "Unique", "Compress", "TopK"})
#: Ops that draw random numbers: a replay would repeat the recorded draws.
RANDOM = frozenset({"Dropout", "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout", "RandomNormal",
                    "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"})
#: Integer shape arithmetic copied into the tail with the ``Shape``/``Size`` nodes it starts from.
_SHAPE_OPS = frozenset({"Shape", "Size", "Constant", "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast",
                        "Add", "Sub", "Mul", "Div", "ReduceProd", "Identity"})


@dataclass(frozen=True)
class CaptureSplit:
    """A training graph cut for capture.

    Attributes:
        head: The recorded part: every node but the tail's; its outputs are the training graph's outputs it computes
            and then ``boundary``.
        tail: The nodes that cannot be recorded and what depends on them, or None when every node can.
        boundary: The head's tensors the tail reads, in the order the head outputs them (without declared types: the
            rank reads them from the head's session).
    """

    head: onnx.ModelProto
    tail: onnx.ModelProto | None
    boundary: tuple[str, ...]


def random_ops(model: onnx.ModelProto) -> list[str]:
    """The random operators of a graph, as ``"Op 'name'"``."""
    return [f"{n.op_type} '{n.name or n.output[0]}'" for n in model.graph.node if n.op_type in RANDOM]


def split_for_capture(model: onnx.ModelProto) -> CaptureSplit:
    """Cut ``model`` (a training graph) into a recordable head and the tail that cannot be recorded.

    Raises:
        ValueError: the graph has random operators (see the module docstring).
    """
    randoms = random_ops(model)
    if randoms:
        raise ValueError(f"random operators cannot be replayed from a CUDA graph: {', '.join(randoms[:5])}")
    graph = model.graph
    tail_nodes = _downstream(graph, [i for i, n in enumerate(graph.node) if n.op_type in UNCAPTURABLE])
    if not tail_nodes:
        return CaptureSplit(model, None, ())
    tail_nodes = _with_exclusive_producers(graph, tail_nodes)
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    copied = _shape_ancestry(graph, producer, tail_nodes)
    cut = set(tail_nodes)
    head_idx = [i for i in range(len(graph.node)) if i not in cut]  # the copied shape nodes stay in the head too
    tail_set = cut | copied
    tail_idx = sorted(tail_set)
    produced_in_tail = {o for i in tail_idx for o in graph.node[i].output if o}
    initializers = {t.name for t in graph.initializer}
    inputs = {v.name: v for v in graph.input}
    reads = [x for i in tail_idx for x in graph.node[i].input if x and x not in produced_in_tail]
    boundary = tuple(dict.fromkeys(x for x in reads if x not in inputs and x not in initializers))
    outputs_by_tail = [v for v in graph.output if v.name in produced_in_tail]
    head_outputs = [v for v in graph.output if v.name not in produced_in_tail]
    head_outputs += [helper.make_empty_tensor_value_info(n) for n in boundary
                     if n not in {v.name for v in head_outputs}]
    head = _subgraph(model, _live(graph, head_idx, {v.name for v in head_outputs}), list(graph.input), head_outputs,
                     "head")
    tail_inputs = [inputs[x] for x in dict.fromkeys(reads) if x in inputs]
    tail_inputs += [helper.make_empty_tensor_value_info(n) for n in boundary]
    tail = _subgraph(model, tail_idx, tail_inputs, outputs_by_tail, "tail")
    return CaptureSplit(head, tail, boundary)


def _downstream(graph: onnx.GraphProto, start: list[int]) -> list[int]:
    """The nodes ``start`` and every node that reads (transitively) what they compute, in graph order."""
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(i)
    found, frontier = set(start), list(start)
    while frontier:
        for out in graph.node[frontier.pop()].output:
            for j in consumers.get(out, ()):
                if j not in found:
                    found.add(j)
                    frontier.append(j)
    return sorted(found)


def _with_exclusive_producers(graph: onnx.GraphProto, tail: list[int]) -> list[int]:
    """``tail`` and every head node whose results only the tail reads (transitively; none a graph output).

    The engine fuses a node into its only reader (a gradient ``Gemm`` into the ``Sum`` that adds the tied embedding's
    two shares, computing ``A @ B + C`` with one rounding): a cut between them would leave two roundings in the cut's
    sessions, so in fp16 they would not give the unsplit call's bits. Moving such producers to the tail keeps every
    pair the engine can fuse in one session."""
    consumers: dict[str, set[int]] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, set()).add(i)
    outputs = {v.name for v in graph.output}
    found, changed = set(tail), True
    while changed:
        changed = False
        for i in range(len(graph.node) - 1, -1, -1):
            results = [o for o in graph.node[i].output if o]
            if i in found or not results or any(o in outputs for o in results):
                continue
            readers = set().union(*(consumers.get(o, set()) for o in results))
            if readers and readers <= found:
                found.add(i)
                changed = True
    return sorted(found)


def _live(graph: onnx.GraphProto, nodes: list[int], outputs: set[str]) -> list[int]:
    """``nodes`` less those whose results nothing in them or ``outputs`` reads (shape nodes only the tail needed)."""
    needed, kept = set(outputs), []
    for i in reversed(nodes):
        if any(o in needed for o in graph.node[i].output):
            kept.append(i)
            needed.update(graph.node[i].input)
    return kept[::-1]


def _shape_ancestry(graph: onnx.GraphProto, producer: dict[str, int], tail: list[int]) -> set[int]:
    """Head nodes to copy into the tail: the shape computations (from ``Shape``/``Size``/constants) it reads."""
    tail_set, copied = set(tail), set()

    def shape_only(i: int, seen: set[int]) -> bool:
        node = graph.node[i]
        if node.op_type not in _SHAPE_OPS or i in seen:
            return False
        if node.op_type in ("Shape", "Size", "Constant"):
            return True
        seen = seen | {i}
        return all(x not in producer or shape_only(producer[x], seen) for x in node.input if x)

    def copy(i: int) -> None:
        if i in copied or i in tail_set:
            return
        copied.add(i)
        if graph.node[i].op_type not in ("Shape", "Size"):
            for x in graph.node[i].input:
                if x in producer:
                    copy(producer[x])

    for i in tail:
        for x in graph.node[i].input:
            if x in producer and producer[x] not in tail_set and shape_only(producer[x], set()):
                copy(producer[x])
    return copied


def _subgraph(model: onnx.ModelProto, nodes: list[int], inputs: list, outputs: list, part: str) -> onnx.ModelProto:
    graph = model.graph
    chosen = [graph.node[i] for i in nodes]
    read = {x for n in chosen for x in n.input}
    made = {o for n in chosen for o in n.output}
    known = {v.name for v in inputs}
    initializers = [t for t in graph.initializer if t.name in read and t.name not in known]
    value_info = [v for v in graph.value_info if v.name in made or v.name in read]
    sub = helper.make_graph(chosen, f"{graph.name}-{part}", [v for v in inputs if v.name in read], outputs,
                            initializers, value_info=value_info)
    out = helper.make_model(sub, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    out.producer_name = model.producer_name
    return out
