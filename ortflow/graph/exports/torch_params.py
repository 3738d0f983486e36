"""The torch model's parameters in a dynamo export: one initializer per torch parameter, under its torch name and in
its torch layout, and every other float initializer (buffers, constants the exporter computed) frozen.

The dynamo exporter (``torch.onnx.export(..., dynamo=True)``, torch's default since 2.9) writes what it knows of the
torch program as metadata: each parameter initializer it keeps under its torch name carries
``pkg.torch.export.graph_signature.InputSpec.kind`` (``PARAMETER`` / ``BUFFER``) and the placeholder name
(``p_<name with dots as underscores>``); each node carries ``pkg.torch.onnx.fx_node`` (the torch op and its arguments,
placeholders included) and ``pkg.torch.onnx.name_scopes`` (the module path). With its default ``optimize=True`` the
exporter then folds and merges initializers: a Linear weight becomes a pre-transposed ``val_NN``, equal-valued tensors
(a fresh model's norm weights, zero biases) become one, a zero bias may be dropped, an eval-mode BatchNorm is folded
into the Linear or Conv before it (refused: nothing of it is left to train). :func:`torch_parameters` reads the
metadata back and undoes that: a renamed tensor gets its torch name, a transposed one is stored in torch's layout
behind a ``Transpose`` node, a merged one is untied into one copy per torch parameter. Where the metadata does not say
which parameter a tensor is, or a parameter has no tensor left, it refuses with the export call that keeps them.

TorchScript exports carry no such metadata: :func:`torch_parameters` returns None for them.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ortflow.graph.onnx_tools import FLOAT_TYPES, GraphError, Names

KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
PERSISTENT = "pkg.torch.export.graph_signature.InputSpec.persistent"
ORIGINAL = "pkg.torch.onnx.original_node_name"
FX_NODE = "pkg.torch.onnx.fx_node"
SCOPES = "pkg.torch.onnx.name_scopes"
CLASSES = "pkg.torch.onnx.class_hierarchy"
#: The graph's record of torch's program signature: one line per parameter and buffer, in torch's order, with its
#: placeholder and its torch name (``p_model_encoder_block_0_layer_0_selfattention_q_weight: PARAMETER
#: target='model.encoder.block.0.layer.0.SelfAttention.q.weight'``: the placeholder is lower case, the name is not),
#: every name of a tied parameter included.
SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
_SIGNED = re.compile(r"^(\w+): (PARAMETER|BUFFER) target='([^']+)'", re.MULTILINE)
#: The onnxscript optimiser's record, on the value of a tensor it computed by constant folding, of the tensors it
#: computed it from.
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
#: The export call that keeps every parameter as its own initializer under its torch name.
NO_OPTIMIZE = "torch.onnx.export(model, args, path, dynamo=True, optimize=False)"
# Which argument of a torch module's op an ONNX input holds, where an fx node reads several parameters (a Linear's
# weight and bias): the suffix of the parameter's name.
_ROLES = {("MatMul", 1): "weight", ("Gemm", 1): "weight", ("Gemm", 2): "bias", ("Conv", 1): "weight",
          ("Conv", 2): "bias", ("Add", 0): "bias", ("Add", 1): "bias", ("LayerNormalization", 1): "weight",
          ("LayerNormalization", 2): "bias", ("Mul", 0): "weight", ("Mul", 1): "weight"}
# Torch leaf modules whose forward reads its own ``weight``: read under another module's name, the parameter is tied.
_LEAVES = ("torch.nn.modules.sparse.Embedding", "torch.nn.modules.linear.Linear")


@dataclass(frozen=True)
class TorchParameters:
    """What :func:`torch_parameters` found and did.

    Attributes:
        model: The export with one initializer per torch parameter, named and shaped as in torch.
        trained: Torch parameter name -> where it came from (``"initializer"``, ``"transposed"`` and ``"merged"``
            with the export's tensor name).
        aliases: Torch parameter name -> the other state-dict names tied to it (a tied embedding and LM head).
        untied: One line per merged tensor split back into its torch parameters.
        frozen: Float initializer -> why it is not trained (a buffer, a constant the exporter computed).
        persistent: The torch buffers kept under their names that belong in the state dict (``persistent``).
        padding: Each embedding table read with torch's ``padding_idx`` -> that row: torch's lookup gives the row no
            gradient, the exported ``Gather`` does (:func:`padding_rows`).
    """

    model: onnx.ModelProto
    trained: dict[str, dict] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    untied: list[str] = field(default_factory=list)
    frozen: dict[str, str] = field(default_factory=dict)
    persistent: list[str] = field(default_factory=list)
    padding: dict[str, int] = field(default_factory=dict)

    def to_record(self) -> dict:
        """The ``torch`` entry of configure.json."""
        return {"parameters": self.trained, "aliases": self.aliases, "untied": self.untied, "frozen": self.frozen,
                "persistent_buffers": self.persistent, "padding_rows": self.padding}


def is_dynamo_export(model: onnx.ModelProto) -> bool:
    """Whether the model carries the dynamo exporter's torch metadata."""
    keys = {p.key for v in (*model.graph.value_info, *model.graph.input) for p in v.metadata_props}
    return KIND in keys or any(p.key == FX_NODE for n in model.graph.node for p in n.metadata_props)


def _meta(proto) -> dict[str, str]:
    return {p.key: p.value for p in proto.metadata_props}


def _scopes(node: onnx.NodeProto) -> list[str]:
    try:
        return [s for s in ast.literal_eval(_meta(node).get(SCOPES, "[]")) if isinstance(s, str)]
    except (ValueError, SyntaxError):
        return []


def _placeholders(node: onnx.NodeProto) -> list[str]:
    """The parameter placeholders (``p_...``) the node's fx op reads, in argument order."""
    return re.findall(r"%(p_\w+)", _meta(node).get(FX_NODE, ""))


def _target(node: onnx.NodeProto) -> str:
    found = re.search(r"target=([\w.]+)", _meta(node).get(FX_NODE, ""))
    return found.group(1) if found else ""


class _Reader:
    """The export's parameter placeholders, their torch names, and which placeholder each use of a tensor holds."""

    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.kinds: dict[str, str] = {}
        self.persistent: set[str] = set()
        self.names: dict[str, str] = {}  # placeholder -> torch name
        for value in (*self.graph.value_info, *self.graph.input):
            meta = _meta(value)
            if KIND in meta:
                self.kinds[value.name] = meta[KIND]
                if meta.get(PERSISTENT) == "True":
                    self.persistent.add(value.name)
                if ORIGINAL in meta:
                    self.names[meta[ORIGINAL]] = value.name
        self.signed: list[str] = []  # the signature's parameter names, in torch's order
        for placeholder, kind, target in _SIGNED.findall(_meta(self.graph).get(SIGNATURE, "")):
            self.names.setdefault(placeholder, target)
            if kind == "PARAMETER":
                self.signed.append(target)
        self.uses: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in self.graph.node:
            for pos, name in enumerate(node.input):
                self.uses[name].append((node, pos))
            for placeholder in _placeholders(node):
                self.names.setdefault(placeholder, self._name_from_scopes(placeholder, _scopes(node)))

    @staticmethod
    def _name_from_scopes(placeholder: str, scopes: list[str]) -> str | None:
        """``p_model_h_0_ln_1_weight`` read inside module ``model.h.0.ln_1`` is ``model.h.0.ln_1.weight``."""
        for scope in sorted(scopes, key=len, reverse=True):
            stem = "p_" + scope.replace(".", "_") + "_"
            if scope and placeholder.startswith(stem):
                return f"{scope}.{placeholder[len(stem):]}"
        return None

    def placeholder(self, tensor: str, node: onnx.NodeProto, pos: int) -> str | None:
        """The parameter a use of ``tensor`` holds; None when the op reads no parameter there or it is ambiguous."""
        candidates = _placeholders(node)
        own = {p for p, n in self.names.items() if n == tensor}
        if own & set(candidates):
            return next(p for p in candidates if p in own)
        named = {p for p in candidates if self.names.get(p) in self.kinds and self.names.get(p) != tensor}
        left = [p for p in candidates if p not in named]  # a parameter that has its own tensor is not this one
        if len(left) > 1:
            role = _ROLES.get((node.op_type, pos))
            left = [p for p in left if role and p.endswith("_" + role)]
        return left[0] if len(left) == 1 else None

    def transposed(self, node: onnx.NodeProto, pos: int) -> bool:
        """Whether a Linear's weight is read here in the transposed layout the exporter folded (MatMul's B)."""
        if not _target(node).startswith("torch.ops.aten.linear"):
            return False
        if node.op_type == "MatMul":
            return pos == 1
        if node.op_type == "Gemm" and pos == 1:
            return not any(a.name == "transB" and a.i for a in node.attribute)
        return False

    def alias(self, node: onnx.NodeProto, torch_name: str) -> str | None:
        """Another state-dict name of the parameter, when a torch leaf module reads it as its own ``weight``."""
        classes, scopes = _meta(node).get(CLASSES, ""), _scopes(node)
        if len(scopes) < 2 or not any(f"'{leaf}'" in classes for leaf in _LEAVES):
            return None
        module = scopes[-2]
        attr = torch_name.rsplit(".", 1)[-1]
        return f"{module}.{attr}" if not torch_name.startswith(module + ".") else None


def torch_parameters(model: onnx.ModelProto) -> TorchParameters | None:
    """One initializer per torch parameter (named and shaped as in torch), the rest frozen; None for a TorchScript
    export.

    Args:
        model: The dynamo export with its weights loaded (left unchanged).

    Returns:
        The rewritten model and the record of what is trained under which torch name, untied and frozen.

    Raises:
        GraphError: A tensor whose parameter the metadata does not name, or a parameter without a tensor (the
            exporter merged or dropped it); the message gives the export call that keeps them.
    """
    if not is_dynamo_export(model):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    reader = _Reader(out)
    holders: dict[str, list[tuple[str, onnx.NodeProto, int, bool]]] = defaultdict(list)  # torch name -> uses
    frozen: dict[str, str] = {}
    aliases: dict[str, set[str]] = defaultdict(set)
    first: dict[str, str] = {}  # torch name -> the name of the module that reads it first (tied: torch's order)
    unknown: list[str] = []
    for tensor in out.graph.initializer:
        if tensor.data_type not in FLOAT_TYPES:
            continue
        kind = reader.kinds.get(tensor.name)
        if kind == "BUFFER":
            kept = "in the state dict" if tensor.name in reader.persistent else "not in the state dict"
            frozen[tensor.name] = f"a torch buffer ({kept}): not a parameter"
            continue
        found = []
        for node, pos in reader.uses.get(tensor.name, []):
            placeholder = reader.placeholder(tensor.name, node, pos)
            torch_name = reader.names.get(placeholder) if placeholder else None
            if torch_name is None:
                continue
            found.append((torch_name, node, pos))
            alias = reader.alias(node, torch_name)
            first.setdefault(torch_name, alias or torch_name)
            if alias:
                aliases[torch_name].add(alias)
        if not found:
            if kind == "PARAMETER":
                unknown.append(f"'{tensor.name}' is a parameter that no op reads as one")
            else:
                frozen[tensor.name] = "a constant the exporter computed, not a torch parameter: a Constant node"
            continue
        seen = {(id(n), p) for _, n, p in found}
        uses_without = [u for u in reader.uses.get(tensor.name, []) if (id(u[0]), u[1]) not in seen]
        if uses_without:
            node = uses_without[0][0]
            unknown.append(f"'{tensor.name}' is read as a parameter and also by {node.op_type} '{node.name}', "
                           "which reads no parameter there")
            continue
        for torch_name, node, pos in found:
            holders[torch_name].append((tensor.name, node, pos, reader.transposed(node, pos)))
    referenced = {reader.names.get(p) for n in out.graph.node for p in _placeholders(n)} - {None}
    missing = sorted(referenced - set(holders))
    recurrent, computed = _computed_recurrent_weights(out.graph, reader, set(missing))
    held = set(holders) | {a for found in aliases.values() for a in found}
    problems = _folded_batchnorms(out.graph) + recurrent + unknown
    problems += [f"parameter '{name}' has no tensor in the export (merged or dropped)" for name in missing
                 if name not in computed]
    problems += _parameters_folded_into_constants(out.graph, held | set(missing) | computed)
    if problems:
        raise GraphError(
            "model.path: the dynamo exporter's optimisation merged, dropped, folded or recomputed torch parameters, so "
            "training this export would not train the torch model: " + "; ".join(problems[:4])
            + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            + f". Export with `{NO_OPTIMIZE}`, which keeps every parameter under its torch name"
        )
    alias_lists = {}
    _unread_names_of_the_tie(reader, aliases, referenced | set(holders) | {t.name for t in out.graph.initializer})
    for name, found in aliases.items():  # a tied parameter is trained under torch's name for it (the signature's
        # first), else under the name its first reader gives it
        signed = [n for n in reader.signed if n in found | {name}]
        canonical = signed[0] if signed else first[name] if first[name] not in holders else name
        holders[canonical] = holders.pop(name)
        alias_lists[canonical] = sorted((found | {name}) - {canonical} - set(holders))
    trained, untied = _rewrite(out, holders)
    _constants_as_nodes(out.graph, {n for n, why in frozen.items() if why.endswith("a Constant node")})
    _clear_intermediate_types(out.graph)
    persistent = sorted(name for name in reader.persistent if name in frozen)
    return TorchParameters(out, trained, {k: v for k, v in sorted(alias_lists.items()) if v}, untied, frozen,
                           persistent, padding_rows(out.graph))


def _unread_names_of_the_tie(reader: _Reader, aliases: dict[str, set[str]], read: set[str]) -> None:
    """Add to the one tied parameter of ``aliases`` the signature's parameter names that no op reads and that
    have no tensor (``read``: the names read or held; an unused parameter keeps a tensor of its own): torch's other
    names of it, read by no module of their own (T5's ``shared.weight``, the module whose ``weight`` both stacks'
    ``embed_tokens`` and the LM head read, and torch's name for all of them). With two tied parameters, which one
    such a name belongs to is not recorded: none is added."""
    unread = [n for n in reader.signed if n not in read and not any(n in found for found in aliases.values())]
    if unread and len(aliases) == 1:
        next(iter(aliases.values())).update(unread)


def padding_rows(graph: onnx.GraphProto) -> dict[str, int]:
    """Each table an ``nn.Embedding`` with ``padding_idx`` reads (``aten.embedding(weight, ids, padding_idx)`` in the
    ``Gather``'s fx node) -> its padding row. Torch's lookup gives that row no gradient; ONNX has no such argument,
    so the exported ``Gather`` passes the padding positions' gradient to the row like any other's (a row tied to an
    LM head still gets the head's gradient in both)."""
    found = {}
    for node in graph.node:
        args = re.search(r"aten\.embedding\.default\]\(args = \(%\w+, %\w+, (-?\d+)", _meta(node).get(FX_NODE, ""))
        if node.op_type == "Gather" and args and int(args.group(1)) >= 0:
            found[node.input[0]] = int(args.group(1))
    return found


def _folded_batchnorms(graph: onnx.GraphProto) -> list[str]:
    """One line per BatchNorm the optimiser folded into the Gemm or Conv before it (eval mode): the node keeps the
    BatchNorm's fx node, and its tensors are the fused layer's, so nothing of the BatchNorm is left to train."""
    found = []
    for node in graph.node:
        if "batch_norm" in _target(node) and node.op_type != "BatchNormalization":
            scopes = [s for s in _scopes(node) if s]
            module = scopes[-2] if len(scopes) > 1 else (scopes[0] if scopes else node.name)
            found.append(f"BatchNorm '{module}' was folded into the {node.op_type} before it "
                         f"({', '.join(repr(i) for i in node.input[1:] if i)}), so its weight, bias and running "
                         "statistics have no tensors of their own")
    return found


def _parameters_folded_into_constants(graph: onnx.GraphProto, accounted: set[str]) -> list[str]:
    """One line per torch parameter the optimiser folded into a constant it computed (Gemma's RMSNorm ``1 + weight``
    written as the sum's values): no op reads the parameter any more, so only the optimiser's :data:`FOLDED_FROM`
    record on the constant names it. A folded torch name is a parameter where its last part names a weight or a bias
    (torch's layers name theirs so; a buffer folded into a constant, RoPE's ``inv_freq``, is rightly frozen).
    ``accounted``: the parameters already held by a tensor or reported."""
    found = []
    for value in graph.value_info:
        try:
            sources = ast.literal_eval(_meta(value).get(FOLDED_FROM, "[]"))
        except (ValueError, SyntaxError):
            continue
        for name in sources if isinstance(sources, list) else []:
            last = name.rsplit(".", 1)[-1] if isinstance(name, str) and "." in name else ""
            if ("weight" in last or "bias" in last) and name not in accounted:
                found.append(f"parameter '{name}' has no tensor in the export: the optimiser folded it into the "
                             f"constant '{value.name}' it computed from it")
                accounted = accounted | {name}
    return found


def _computed_recurrent_weights(graph: onnx.GraphProto, reader: _Reader,
                                missing: set[str]) -> tuple[list[str], set[str]]:
    """One line per LSTM, GRU or RNN node whose torch weights have no tensor: the optimiser computed them, put into
    the ONNX op's gate order, into new constants the node reads. Returns the lines and the parameters they name."""
    found, named = [], set()
    for node in graph.node:
        if node.op_type not in ("LSTM", "GRU", "RNN"):
            continue
        lost = [name for name in (reader.names.get(p) for p in _placeholders(node)) if name in missing]
        if not lost:
            continue
        scopes = [s for s in _scopes(node) if s]
        module = scopes[-2] if len(scopes) > 1 else (scopes[0] if scopes else node.name)
        found.append(f"{node.op_type} '{module}' reads its weights as constants the optimiser computed in the ONNX "
                     f"gate order ({', '.join(repr(i) for i in node.input[1:4] if i)}), so "
                     f"{', '.join(repr(n) for n in lost)} have no tensors of their own")
        named.update(lost)
    return found, named


def _rewrite(model: onnx.ModelProto, holders: dict) -> tuple[dict[str, dict], list[str]]:
    """Give each torch parameter its own initializer in torch's layout and rewire its uses; returns the record."""
    graph = model.graph
    names = Names(graph)
    tensors = {t.name: t for t in graph.initializer}
    per_tensor: dict[str, set[str]] = defaultdict(set)
    for torch_name, uses in holders.items():
        per_tensor.update({u[0]: per_tensor[u[0]] | {torch_name} for u in uses})
    trained: dict[str, dict] = {}
    untied = [f"'{t}' holds {len(p)} torch parameters the exporter merged (equal values): {sorted(p)}"
              for t, p in sorted(per_tensor.items()) if len(p) > 1]
    new_nodes: list[onnx.NodeProto] = []
    keep: set[str] = set()
    for torch_name, uses in sorted(holders.items()):
        sources = {u[0] for u in uses}
        values = {(src, flip): _layout(tensors[src], flip) for src, _, _, flip in uses}
        first = next(iter(values.values()))
        if any(not np.array_equal(v, first) for v in values.values()):
            raise GraphError(f"model.path: the export holds different values for torch parameter '{torch_name}' in "
                             f"{sorted(sources)}; export with `{NO_OPTIMIZE}`")
        tensor = numpy_helper.from_array(first, torch_name)
        keep.add(torch_name)
        transposed_name = None
        for _, node, pos, flip in uses:
            if flip:
                if transposed_name is None:
                    transposed_name = names.new(f"{torch_name}/transposed")
                    new_nodes.append(helper.make_node("Transpose", [torch_name], [transposed_name],
                                                      name=names.new(f"{torch_name}/Transpose"), perm=[1, 0]))
                node.input[pos] = transposed_name
            else:
                node.input[pos] = torch_name
        how = "merged" if any(len(per_tensor[s]) > 1 for s in sources) else (
            "transposed" if transposed_name else "initializer")
        trained[torch_name] = {"from": sorted(sources)[0], "how": how, "shape": list(first.shape)}
        _replace_initializer(graph, tensor, tensors)
    used = {n for node in graph.node for n in node.input} | {o.name for o in graph.output}
    stale = [t for t in graph.initializer if t.name in per_tensor and t.name not in keep and t.name not in used]
    for t in stale:
        graph.initializer.remove(t)
    for value in [v for v in graph.value_info if v.name in {t.name for t in stale}]:
        graph.value_info.remove(value)
    _place_before_readers(graph, new_nodes)
    return trained, untied


def _place_before_readers(graph: onnx.GraphProto, added: list[onnx.NodeProto]) -> None:
    """Put each added node (it reads only initializers) just before the first node that reads its output, where
    torch's own ``Transpose`` of a Linear weight is (the pipeline cuts follow graph order)."""
    pending = {node.output[0]: node for node in added}
    nodes = []
    for node in graph.node:
        for name in node.input:
            if name in pending:
                nodes.append(pending.pop(name))
        nodes.append(node)
    nodes.extend(pending.values())
    del graph.node[:]
    graph.node.extend(nodes)


def _constants_as_nodes(graph: onnx.GraphProto, names: set[str]) -> None:
    """The initializers ``names`` as ``Constant`` nodes (first in the graph): values the exporter computed, which
    are no parameters and never change, as TorchScript writes them (no checkpoint entry, no pipeline state)."""
    tensors = [t for t in graph.initializer if t.name in names]
    constants = [helper.make_node("Constant", [], [t.name], name=f"{t.name}/constant", value=t) for t in tensors]
    for tensor in tensors:
        graph.initializer.remove(tensor)
    nodes = [*constants, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)


def _layout(tensor: onnx.TensorProto, transposed: bool) -> np.ndarray:
    values = numpy_helper.to_array(tensor)
    return values.T.copy() if transposed else values


def _replace_initializer(graph: onnx.GraphProto, tensor: onnx.TensorProto, tensors: dict) -> None:
    """Put ``tensor`` in the graph under its name (replacing one of that name)."""
    old = tensors.get(tensor.name)
    if old is not None:
        old.CopyFrom(tensor)
    else:
        graph.initializer.append(tensor)
        tensors[tensor.name] = graph.initializer[-1]



def _clear_intermediate_types(graph: onnx.GraphProto) -> None:
    """Drop the intermediate types the exporter declares (``value_info``, dims written as expressions of its symbols
    such as ``s33*Min(64, s50)``): the passes and splits change shapes (a tensor-parallel slice halves a Linear's
    output), and a stale declaration then contradicts shape inference, which derives them again from the inputs."""
    del graph.value_info[:]
