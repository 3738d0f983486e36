"""Pipeline split: one ONNX model -> P stage models cut at tensors along the graph's topological order.

A cut is a tensor name; the nodes up to and including its producer (in the graph's order) go to the stages before
it. What a boundary carries is every tensor produced before the cut and read after it. The split handles:

* **free nodes** (no trainable parameter among their ancestors: Constant nodes, masks and shape arithmetic computed
  from the inputs or from frozen initializers) are copied into every stage that reads them, so they never cross;
* **graph inputs** (the batch) are fed to every stage that reads them: every rank of a pipeline reads the same batch;
* **activations**: float32 tensors computed from trainable parameters cross the boundary; the receiving stage gets
  them as inputs (and sends back their gradients).

A trainable parameter read on both sides of a cut (tied embedding and LM head) is held by every stage that reads it
(``Stage.shared``); the trainer sums the holders' gradients before the update so the copies stay equal.

It refuses, naming the nodes: a non-float tensor computed from parameters that crosses (e.g. ``Shape`` of an
activation read by a later stage's ``Reshape``), a float16, bfloat16 or double activation that crosses (stages send
each other float32), a tensor that crosses two cuts, a model output the last stage does not compute, and random
operators (the stage's forward is recomputed in its backward call, which would draw different random numbers;
docs/engine.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
from onnx import helper

from ortflow.graph.onnx_tools import infer_shapes

log = logging.getLogger(__name__)

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
_RANDOM_OPS = {"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
               "Bernoulli"}


class SplitError(ValueError):
    """The model cannot be cut where asked; the message names the tensors and nodes and what to change."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Attributes:
        index: Stage number, 0 first.
        model: The stage's forward model (its outputs: ``sends`` for a middle stage, the model's outputs for the last).
        receives: Activations it gets from the previous stage (graph inputs of ``model``), in order.
        sends: Activations it passes to the next stage (graph outputs of ``model``), in order.
        data_inputs: Graph inputs of the original model it reads from the batch.
        parameters: Trainable parameters it holds, sorted.
        shared: Its parameters that other stages also read (tied weights), each with every holding stage, in order:
            each holder keeps a copy and the holders sum their gradients before the update, so the copies stay equal.
        frozen: Initializers it holds that are state, not weights (BatchNorm running statistics): the engine keeps and
            updates them and checkpoints save them, untrained.
        share: Its share of the model's compute as :class:`CutEstimate` estimates it (0..1).
    """

    index: int
    model: onnx.ModelProto
    receives: tuple[str, ...]
    sends: tuple[str, ...]
    data_inputs: tuple[str, ...]
    parameters: tuple[str, ...]
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)
    frozen: tuple[str, ...] = ()
    share: float = 0.0


def _producers(graph: onnx.GraphProto) -> dict[str, int]:
    return {out: i for i, node in enumerate(graph.node) for out in node.output if out}


def _free_nodes(graph: onnx.GraphProto, trainable: set[str]) -> set[int]:
    """Nodes with no trainable parameter among their ancestors (the graph is in topological order)."""
    tainted = set(trainable)
    free = set()
    for i, node in enumerate(graph.node):
        if any(name in tainted for name in node.input if name):
            tainted.update(node.output)
        else:
            free.add(i)
    return free


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    try:
        inferred = infer_shapes(model)
    except Exception:  # noqa: BLE001 - onnx raises several kinds; unknown types are then refused as not float
        inferred = model
    g = inferred.graph
    return {vi.name: vi for vi in [*g.value_info, *g.input, *g.output]}


class Analysis:
    """What the split needs to know about a graph: producers, free nodes, the order of the other nodes, last reads."""

    def __init__(self, model: onnx.ModelProto, trainable: set[str]):
        self.model, self.graph, self.trainable = model, model.graph, trainable
        self.producer = _producers(self.graph)
        self.free = _free_nodes(self.graph, trainable)
        self.order = [i for i in range(len(self.graph.node)) if i not in self.free]  # nodes that get a stage
        self.position = {node: pos for pos, node in enumerate(self.order)}
        self.typed = _value_infos(model)
        self.types = {name: vi.type.tensor_type.elem_type for name, vi in self.typed.items()}
        self.types.update({t.name: t.data_type for t in self.graph.initializer})
        self.readers: dict[str, list[int]] = {}
        for i, node in enumerate(self.graph.node):
            for name in node.input:
                if name:
                    self.readers.setdefault(name, []).append(i)

    def crossing(self, cut_pos: int) -> list[str]:
        """Non-free tensors produced at positions <= cut_pos and read by a non-free node after it."""
        out = []
        for pos in range(cut_pos + 1):
            for name in self.graph.node[self.order[pos]].output:
                if any(self.position.get(r, -1) > cut_pos for r in self.readers.get(name, ())):
                    out.append(name)
        return out

    def crossing_counts(self) -> list[int]:
        """How many non-free tensors cross a cut after each position (one sweep over production/last-read spans)."""
        delta = [0] * (len(self.order) + 1)
        for pos, node in enumerate(self.order):
            for name in self.graph.node[node].output:
                last = max((self.position.get(r, -1) for r in self.readers.get(name, ())), default=-1)
                if last > pos:
                    delta[pos] += 1
                    delta[last] -= 1
        counts, running = [], 0
        for d in delta[:-1]:
            running += d
            counts.append(running)
        return counts

    def describe(self, name: str) -> str:
        producer = self.graph.node[self.producer[name]]
        readers = [self.graph.node[r].name or self.graph.node[r].op_type for r in self.readers.get(name, ())]
        return f"'{name}' (made by {producer.op_type} '{producer.name}', read by {readers})"


def check_random_ops(graph: onnx.GraphProto) -> None:
    random = [f"{n.op_type} '{n.name}'" for n in graph.node if n.op_type in _RANDOM_OPS]
    if random:
        raise SplitError(
            f"random operators in a split model: {random[:5]}; with any distributed.recompute_forward a pipeline "
            f"stage or tensor-parallel piece would not train them as the whole model's training call does (recomputed, "
            f"the forward inside the backward call draws other numbers; kept, the forward runs its eval graph, where "
            f"Dropout is off); export the model without dropout/random ops (e.g. torch eval mode), or train it with "
            f"data parallelism"
        )


@dataclass(frozen=True)
class CutPlace:
    """A place where the automatic cuts may cut: the tensor, and the model's estimated compute before it and in all."""

    name: str
    before: int
    total: int

    @property
    def share(self) -> float:
        """The share of the estimated compute before the place (0..1)."""
        return self.before / self.total


class CutEstimate:
    """The model's compute estimated along its graph order, for the automatic cuts (built once: the graph's analysis
    infers its shapes).

    A stage's compute is estimated from the trainable parameters its nodes read, per token: a node that multiplies by
    or adds a parameter (MatMul, Gemm, Conv, LayerNormalization, Add...) does work in proportion to its size, a Gather
    from a table in proportion to one row (an embedding costs little, its tied LM head a full product), and a
    parameter read by two nodes counts at each. Activations kept for the backward grow with the same work, so this
    balances a stage's activation memory too. Work without parameters (attention's scores, the loss's softmax over
    the vocabulary) is not counted: where a stage measures busier than its estimate, name the cuts
    (``model.pipeline_cuts``) from :meth:`places`.
    """

    def __init__(self, model: onnx.ModelProto, trainable: Sequence[str]):
        a = Analysis(model, set(trainable))
        shapes = {t.name: list(t.dims) for t in a.graph.initializer if t.name in a.trainable}
        self.analysis, self.before, total = a, [], 0  # before: the compute at or before each position
        for i in a.order:
            node = a.graph.node[i]
            for name in set(_parameters_read(a, node, shapes)):
                size = _numel_of(shapes[name])
                total += size // max(shapes[name][0], 1) if node.op_type in _ROW_READS else size
            self.before.append(total)
        self.total = max(total, 1)
        self._places: list[CutPlace] | None = None

    def places(self) -> list[CutPlace]:
        """Where the automatic cuts may cut, in graph order, each with the compute before it: the positions where
        exactly one float32 activation crosses (the residual stream between transformer blocks and between a block's
        attention and its MLP, the hidden state between MLP layers), the first of each run of positions with no
        parameter read between them (two such cuts would leave a stage without a parameter: a norm's parameter-free
        arithmetic between a residual add and its weight)."""
        if self._places is None:
            a, before, found = self.analysis, self.before, []
            for pos, count in enumerate(a.crossing_counts()[:-1]):
                if count == 1:
                    (name,) = a.crossing(pos)
                    fresh = not found or before[found[-1][0]] < before[pos]  # a parameter read since the last
                    float32 = a.types.get(name) == onnx.TensorProto.FLOAT
                    if float32 and 0 < before[pos] < self.total and fresh:  # parameters on both sides
                        found.append((pos, name))
            self._places = [CutPlace(name, before[pos], self.total) for pos, name in found]
        return self._places

    def shares(self, cuts: Sequence[str]) -> list[float]:
        """Each stage's share of the estimated compute for ``cuts``."""
        a = self.analysis
        edges = [self.before[a.position[a.producer[name]]] / self.total if name in a.producer
                 and a.producer[name] in a.position else 0.0 for name in cuts]
        bounds = [0.0, *edges, 1.0]
        return [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]

    def choose(self, num_stages: int) -> list[str]:
        """Cut tensors that balance the stages' estimated compute over ``num_stages`` stages: for each boundary, the
        place whose share of the compute before it is closest to ``s / num_stages``.

        Raises:
            SplitError: There are fewer places than boundaries (the message names the most stages the model splits
                into).
        """
        places = self.places()
        if len(places) < num_stages - 1:
            raise SplitError(
                f"the model has {len(places)} place(s) where a single activation crosses between its parameters, so "
                f"its automatic cuts make at most {len(places) + 1} stages, each holding a parameter; {num_stages} "
                f"stages need {num_stages - 1} cuts: use distributed.pipeline_parallel_size {len(places) + 1} or "
                "fewer, or name the cuts in model.pipeline_cuts"
            )
        cuts: list[str] = []
        last = -1
        for s in range(1, num_stages):
            pool = list(enumerate(places))[last + 1:]
            pool = pool[: len(pool) - (num_stages - 1 - s)]  # a place left for each later boundary
            index, place = min(pool, key=lambda c, s=s: abs(c[1].before - c[1].total * s / num_stages))
            cuts.append(place.name)
            last = index
        return cuts


_ROW_READS = {"Gather", "GatherND", "GatherElements"}  # read a row per index, not the whole table
_PASS_THROUGH = {"Transpose", "Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze"}  # a parameter seen through


def _parameters_read(a: Analysis, node: onnx.NodeProto, shapes: dict) -> list[str]:
    """The trainable parameters ``node`` reads, directly or through a chain of pass-through nodes (an LM head's
    ``MatMul(x, Transpose(wte))``)."""
    found = []
    for name in node.input:
        while name and name not in shapes and name in a.producer:
            producer = a.graph.node[a.producer[name]]
            if producer.op_type not in _PASS_THROUGH or not producer.input:
                break
            name = producer.input[0]
        if name in shapes:
            found.append(name)
    return found if node.op_type not in _PASS_THROUGH else []


def _numel_of(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def split_model(model: onnx.ModelProto, cuts: Sequence[str], trainable: Sequence[str]) -> list[Stage]:
    """Cut ``model`` into ``len(cuts) + 1`` stages at the named tensors (pure: ``model`` is not changed).

    Args:
        model: The user's model (topologically sorted, as ONNX requires).
        cuts: Tensor names, one per boundary, in graph order.
        trainable: The trainable parameter names (float initializers not frozen).

    Raises:
        SplitError: A cut is unknown, out of order, or crossed by a tensor the split cannot carry (names its nodes).
    """
    graph = model.graph
    check_random_ops(graph)
    a = Analysis(model, set(trainable))
    positions = []
    for name in cuts:
        if name not in a.producer:
            raise SplitError(f"model.pipeline_cuts: '{name}' is not a tensor computed by the model")
        node = a.producer[name]
        if node in a.free:
            raise SplitError(f"model.pipeline_cuts: '{name}' does not depend on any trainable parameter; cut after one")
        positions.append(a.position[node])
    if positions != sorted(set(positions)) or (positions and positions[-1] >= len(a.order) - 1):
        raise SplitError(f"model.pipeline_cuts {list(cuts)} must be distinct, in graph order, and before the last node")
    stage_of = {}
    for pos, node in enumerate(a.order):
        stage_of[node] = sum(1 for p in positions if p < pos)
    boundaries = [_check_boundary(a, pos, s) for s, pos in enumerate(positions)]
    shared = _tied(a, stage_of)
    num = len(cuts) + 1
    stages = []
    for s in range(num):
        receives = boundaries[s - 1] if s > 0 else []
        sends = boundaries[s] if s < num - 1 else [o.name for o in graph.output]
        if s == num - 1:
            stray = [o for o in sends if o in a.producer and stage_of.get(a.producer[o], num - 1) != s]
            if stray:
                raise SplitError(f"model outputs {stray} are computed before the last cut; move the cuts earlier")
        nodes = [n for n in a.order if stage_of[n] == s]
        stage = stage_model(a, s, nodes, receives, sends)
        stage.shared.update({n: holders for n, holders in shared.items() if s in holders})
        stages.append(stage)
    for st in stages:
        log.info("pipeline stage %d: %d nodes, %d parameters, receives %s, sends %s", st.index,
                 len(st.model.graph.node), len(st.parameters), list(st.receives), list(st.sends))
    return stages


def _check_boundary(a: Analysis, pos: int, index: int) -> list[str]:
    crossing = a.crossing(pos)
    bad = [a.describe(n) for n in crossing if a.types.get(n) not in FLOAT_TYPES]
    if bad:
        raise SplitError(
            f"cut {index + 1} is crossed by non-float tensors computed from parameters, which carry no gradient: "
            f"{bad}; move the cut so that these are made and read in one stage"
        )
    other = [f"{a.describe(n)} of type {onnx.TensorProto.DataType.Name(a.types[n]).lower()}" for n in crossing
             if a.types.get(n) != onnx.TensorProto.FLOAT]
    if other:
        raise SplitError(
            f"cut {index + 1} is crossed by {'; '.join(other)}: pipeline stages send each other float32 activations "
            "and gradients; cut where a float32 activation crosses (`ortflow validate` lists the places), or export "
            "the model's graph in float32 (the precision section casts inside each stage)"
        )
    return crossing


def _tied(a: Analysis, stage_of: dict[int, int]) -> dict[str, tuple[int, ...]]:
    """Trainable parameters read in more than one stage (a tied embedding and LM head), with their stages."""
    shared = {}
    for name in sorted(a.trainable):
        stages = tuple(sorted({stage_of[r] for r in a.readers.get(name, ()) if r in stage_of}))
        if len(stages) > 1:
            shared[name] = stages
            log.info("tied parameter '%s' is read in stages %s: each holds a copy, their gradients are summed",
                     name, list(stages))
    return shared


def stage_model(a: Analysis, s: int, nodes: list[int], receives: list[str], sends: list[str]) -> Stage:
    graph = a.graph
    keep = set(nodes)
    stack = [name for n in nodes for name in graph.node[n].input if name]
    seen: set[str] = set(receives)
    while stack:  # free nodes that the stage's nodes read, transitively
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        producer = a.producer.get(name)
        if producer is not None and producer in a.free and producer not in keep:
            keep.add(producer)
            stack.extend(x for x in graph.node[producer].input if x)
    produced_earlier = [n for n in receives if n in a.producer]
    for name in sends:
        producer = a.producer.get(name)
        if producer is not None and producer not in keep:
            raise SplitError(f"{a.describe(name)} crosses more than one cut; move the cuts so it crosses one")
    ordered = [graph.node[i] for i in sorted(keep)]
    reads = {x for node in ordered for x in node.input if x}
    inits = [t for t in graph.initializer if t.name in reads]
    data_inputs = [i for i in graph.input if i.name in reads and i.name not in {t.name for t in inits}]
    typed = dict(a.typed)
    typed.update({o.name: o for o in graph.output})

    def info(name: str) -> onnx.ValueInfoProto:
        return typed.get(name) or helper.make_tensor_value_info(name, a.types.get(name, onnx.TensorProto.FLOAT), None)

    inputs = [*data_inputs, *(info(n) for n in produced_earlier)]
    value_info = [vi for name, vi in typed.items() if name in reads and name not in receives and name not in sends]
    stage_graph = helper.make_graph(ordered, f"{graph.name or 'model'}_stage{s}", inputs, [info(n) for n in sends],
                                    inits, value_info=value_info)
    stage_model = helper.make_model(stage_graph, opset_imports=list(a.model.opset_import))
    stage_model.ir_version = a.model.ir_version
    stage_model.functions.extend(a.model.functions)
    params = sorted(t.name for t in inits if t.name in a.trainable)
    return Stage(s, stage_model, tuple(receives), tuple(sends), tuple(i.name for i in data_inputs), tuple(params))
