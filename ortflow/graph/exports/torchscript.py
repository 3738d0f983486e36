"""Parameters the TorchScript exporter merged because their values were equal, given back one initializer each.

``torch.onnx.export(model, args, path, dynamo=False)`` de-duplicates initializers by value in eval mode: a freshly
initialised model's equal tensors (every zero bias of one size, every LayerNorm or RMSNorm weight of ones) become one
initializer, and each other parameter is read through ``Identity(kept) -> <its torch name>``. Trained as exported,
they would be one tensor (every norm of the model sharing one weight), and the state dict would lack their names. Each
such ``Identity`` becomes an initializer under its output's name holding the kept tensor's values, so every torch
parameter trains apart, as in torch, under its own name. Tied weights (one torch parameter read by two modules, a
GPT-2's embedding and LM head) are read directly, not through an ``Identity``, and stay one tensor.
"""

from __future__ import annotations

import copy

import onnx

from ortflow.graph.onnx_tools import FLOAT_TYPES


def _merged(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The ``Identity`` nodes that read a float initializer under another parameter's name."""
    graph = model.graph
    floats = {t.name for t in graph.initializer if t.data_type in FLOAT_TYPES}
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    return [n for n in graph.node if n.op_type == "Identity" and n.domain in ("", "ai.onnx") and n.input[0] in floats
            and n.output[0] not in taken and "::" not in n.output[0] and not n.output[0].startswith("/")]


def untie_deduplicated(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with one initializer per parameter the exporter merged (``model`` itself when there is none).

    Returns:
        The model, and one line per parameter given its own tensor.
    """
    found = _merged(model)
    if not found:
        return model, []
    model = copy.deepcopy(model)
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer}
    outputs = {n.output[0]: n.input[0] for n in found}
    lines = []
    for name, kept in outputs.items():
        tensor = graph.initializer.add()
        tensor.CopyFrom(tensors[kept])
        tensor.name = name
        lines.append(f"'{name}' from '{kept}' (the TorchScript exporter merged their equal values)")
    nodes = [n for n in graph.node if not (n.op_type == "Identity" and n.output[0] in outputs)]
    del graph.node[:]
    graph.node.extend(nodes)
    return model, lines


#: Ops through which a torch leaf module reads its own weight (Embedding, Linear), as TorchScript writes them.
_WEIGHT_READERS = frozenset({"Gather", "MatMul", "Gemm", "Transpose"})


def _scope(node: onnx.NodeProto) -> str | None:
    """The module path of a TorchScript node (``/model/lm_head/MatMul`` -> ``model.lm_head``), None if unnamed."""
    if not node.name.startswith("/"):
        return None
    return ".".join(node.name.strip("/").split("/")[:-1])


def tied_names(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The other state-dict names of tied parameters in a TorchScript export: parameter -> names.

    TorchScript writes a tied parameter (a GPT-2's ``lm_head.weight`` that is ``transformer.wte.weight``) once, under
    the name of its first module; a leaf module that reads it as its own weight (Embedding's ``Gather``, Linear's
    ``MatMul``/``Gemm``/``Transpose``) under another module path gives the second name: that path and the
    parameter's own attribute name. A module reading a parameter of one of its submodules is no tie. A module that
    two parents hold (T5's ``shared`` embedding, which is also each stack's ``embed_tokens``) is named in every
    parent's scope by its first name (``/model/encoder/shared/Gather``): that path is no state-dict name, and the
    export records no other, so it gives none.
    """
    floats = {t.name for t in model.graph.initializer if t.data_type in FLOAT_TYPES and "::" not in t.name}
    found: dict[str, set[str]] = {}
    for node in model.graph.node:
        scope = _scope(node)
        if scope is None or node.op_type not in _WEIGHT_READERS:
            continue
        for name in node.input:
            if name not in floats or "." not in name:
                continue
            module, attr = name.rsplit(".", 1)
            if scope.rsplit(".", 1)[-1] == module.rsplit(".", 1)[-1]:
                continue  # the module's own first name under another parent's scope: no torch name
            if scope and scope != module and not scope.startswith(module + ".") and not module.startswith(scope + "."):
                found.setdefault(name, set()).add(f"{scope}.{attr}")
    return {name: sorted(others - floats) for name, others in sorted(found.items()) if others - floats}
