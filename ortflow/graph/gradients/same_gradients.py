"""Received tensors whose gradients are the values of one tensor of the gradient graph.

A tensor-parallel piece receives the partial sum of the previous piece's row-split product and the residual stream,
and adds them (``resid + (mm + bias)``): the engine's gradient of both is the gradient of their sum, passed on through
``Identity`` nodes (and a ``Reshape`` where the product is a ``Gemm`` over the flattened tokens). Each is partial on
every rank and is summed over the tensor-parallel ranks in the backward; where both hold one tensor's values, one sum
serves both (half a transformer block's input-gradient sums).
"""

from __future__ import annotations

import onnx

#: Operators whose output holds their first input's values in the same (row-major) order.
COPIES = ("Identity", "Reshape")


def same_gradients(graph: onnx.GraphProto, outputs: dict[str, str]) -> dict[str, str]:
    """``outputs``: received tensor -> the graph output that holds its gradient, in the order the tensors are
    received. Returns received tensor -> the first earlier received tensor whose gradient output copies the same
    tensor (only ``Identity`` and ``Reshape`` nodes between them: the same values in the same order, bit for bit,
    possibly in another shape); received tensors with a gradient of their own are not keys."""
    producer = {o: n for n in graph.node for o in n.output}

    def source(name: str) -> str:
        seen = set()
        while name in producer and producer[name].op_type in COPIES and name not in seen:
            seen.add(name)
            name = producer[name].input[0]
        return name

    first: dict[str, str] = {}
    same: dict[str, str] = {}
    for received, output in outputs.items():
        origin = source(output)
        if origin in first:
            same[received] = first[origin]
        else:
            first[origin] = received
    return same


def agreed(mappings: list[dict[str, str]]) -> dict[str, str]:
    """The entries every mapping has (each rank's piece of one index: one record serves them all)."""
    if not mappings:
        return {}
    return {k: v for k, v in mappings[0].items() if all(m.get(k) == v for m in mappings[1:])}
