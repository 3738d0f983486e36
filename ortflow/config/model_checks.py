"""Model file problems that the ONNX checker passes and later stages crash or mislead on, named before anything runs.

* a model-local function that calls itself, directly or through others: the engine's and ONNX's function inlining
  recurse until the process dies (SIGSEGV, no message);
* a graph input with a fixed dim of size 0: no batch can be fed (the engine fails inside a kernel);
* external data shorter than the tensor it holds (the engine's error names neither the tensor nor the file);
* NaN values in an initializer: the first loss is NaN, which looks like a learning rate problem.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def _called(nodes: Any, local: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The model-local functions that ``nodes`` call, subgraphs (If, Loop, Scan bodies) included."""
    found, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        if (node.domain, node.op_type) in local:
            found.add((node.domain, node.op_type))
        for attr in node.attribute:
            graphs = [attr.g] if attr.HasField("g") else []
            for graph in [*graphs, *attr.graphs]:
                todo.extend(graph.node)
    return found


def recursive_functions(proto: Any) -> list[str]:
    """Each model-local function that reaches itself through its own calls."""
    local = {(f.domain, f.name) for f in proto.functions}
    calls = {(f.domain, f.name): _called(f.node, local) for f in proto.functions}
    problems = []
    for start in sorted(calls):
        path, todo, seen = {start: [start]}, [start], set()
        while todo:
            here = todo.pop()
            for callee in sorted(calls.get(here, ())):
                if callee == start:
                    chain = " -> ".join(name for _, name in [*path[here], start])
                    problems.append(f"model.path: the local function '{start[1]}' (domain '{start[0]}') calls itself "
                                    f"({chain}); ONNX functions cannot recurse: re-export without recursion")
                    todo = []
                    break
                if callee not in seen:
                    seen.add(callee)
                    path[callee] = [*path[here], callee]
                    todo.append(callee)
    return problems


def zero_dims(proto: Any) -> list[str]:
    """Graph inputs (not initializers) that declare a fixed dim of size 0."""
    initializers = {t.name for t in proto.graph.initializer}
    problems = []
    for info in proto.graph.input:
        if info.name in initializers or not info.type.HasField("tensor_type"):
            continue
        dims = info.type.tensor_type.shape.dim
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") and dim.dim_value == 0:
                shown = [d.dim_param or d.dim_value for d in dims]
                problems.append(f"model.path: input '{info.name}' declares dim {axis} of size 0 (shape {shown}): no "
                                f"data can be fed to it; export it with that dim symbolic (dynamic_axes / "
                                f"dynamic_shapes) or its real size")
    return problems


def _external(tensor: Any) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _itemsize(tensor: Any) -> int | None:
    import onnx

    try:
        return onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None


def short_external_data(proto: Any, folder: Path) -> list[str]:
    """External-data initializers whose file holds fewer bytes than their declared shape needs."""
    import onnx

    problems = []
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info, itemsize = _external(tensor), _itemsize(tensor)
        location = info.get("location", "")
        path = folder / location
        if itemsize is None or "\0" in location or not path.is_file():
            continue  # a bad or missing location is named by the file checks
        want = math.prod(tensor.dims) * itemsize
        offset = int(info.get("offset", 0) or 0)
        have = max(0, os.path.getsize(path) - offset)
        declared = int(info["length"]) if info.get("length") else None
        if have < want or (declared is not None and declared < want):
            problems.append(
                f"model.path: initializer '{tensor.name}' declares shape {list(tensor.dims)} ({want} bytes) but its "
                f"external data file '{location}' holds {min(have, declared if declared is not None else have)} "
                f"bytes from offset {offset}; the data file is truncated or belongs to another export: copy it again "
                f"or re-export the model")
    return problems


def non_finite_initializers(proto: Any, folder: Path, limit: int = 5) -> list[str]:
    """Float initializers holding NaN values (the first ``limit`` named)."""
    import numpy as np
    from onnx import numpy_helper

    problems = []
    for tensor in proto.graph.initializer:
        size = _itemsize(tensor)
        if size is None or tensor.data_type not in (1, 10, 11, 16):  # float, float16, double, bfloat16
            continue
        try:
            values = numpy_helper.to_array(tensor, base_dir=str(folder))
        except Exception:  # noqa: BLE001 - unreadable data is named by the other checks
            continue
        try:  # NaN only: an infinity can be meant (an attention mask's -inf constant)
            nan = int(np.count_nonzero(np.isnan(values)))
        except TypeError:  # a type numpy cannot test (bfloat16 as raw integers)
            continue
        if nan:
            problems.append(f"model.path: initializer '{tensor.name}' holds {nan} NaN value(s) of {np.size(values)}: "
                            f"the model's weights are damaged (training would start from a NaN loss, which is not "
                            f"the learning rate's doing); re-export it from weights without NaN")
            if len(problems) >= limit:
                break
    return problems


def model_structure_problems(proto: Any, folder: Path) -> list[str]:
    """Every problem above, for a model loaded without its external data (``folder``: the model's folder)."""
    return [*recursive_functions(proto), *zero_dims(proto), *short_external_data(proto, folder),
            *non_finite_initializers(proto, folder)]
