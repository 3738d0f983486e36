"""Tied weights that an export's constant folding untied: a trained table and a second trained tensor holding its
transpose (or an exact copy).

``torch.onnx.export(..., do_constant_folding=True)`` folds ``Transpose(wte)`` of a tied embedding and LM head into a
new initializer. The model then trains two tensors that start equal and drift apart: the tie is gone, and the model
has more parameters than the user's (GPT-2 small: 875,264 instead of 842,496 in a 4-layer test export). Nothing in
the graph says the two were one; the values do. This check compares the float initializers whose shapes allow it
(equal, or transposed 2-D) and reports pairs whose values are the same tensor. Configure warns about each pair.
A tensor whose elements are all equal (a freshly initialised bias of zeros, a LayerNorm weight of ones) is an
initialisation, not evidence of a tie: it is never reported, however large.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import numpy_helper

#: Smallest table worth checking: small tensors (biases, LayerNorm weights) are equal by chance after an init.
MIN_VALUES = 1024


def folded_tie_copies(model: onnx.ModelProto, trainable: set[str]) -> list[tuple[str, str, bool]]:
    """Pairs of trained initializers that hold the same values, one maybe the transpose of the other.

    Args:
        model: The model with its weights loaded (initializers without values are skipped).
        trainable: The names ortflow will train.

    Returns:
        ``(first, second, transposed)`` per pair, in initializer order.
    """
    digests: dict[bytes, str] = {}
    arrays: dict[str, np.ndarray] = {}
    found = []
    for tensor in model.graph.initializer:
        if tensor.name not in trainable or tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        if not (tensor.raw_data or tensor.float_data) or np.prod(tensor.dims, dtype=np.int64) < MIN_VALUES:
            continue
        value = numpy_helper.to_array(tensor)
        if value.size and np.all(value == value.flat[0]):
            continue  # constant: equal to any other constant of its shape by initialisation
        arrays[tensor.name] = value
        forms = [(value, False)] + ([(value.T, True)] if value.ndim == 2 else [])
        for form, transposed in forms:
            key = hashlib.sha256(repr(form.shape).encode() + np.ascontiguousarray(form).tobytes()).digest()
            other = digests.get(key)
            if other is not None and np.array_equal(arrays[other], form):
                found.append((other, tensor.name, transposed))
                break
        else:
            digests[hashlib.sha256(repr(value.shape).encode() + np.ascontiguousarray(value).tobytes()).digest()] = \
                tensor.name
    return found


def describe_copies(pairs: list[tuple[str, str, bool]], model: onnx.ModelProto) -> list[str]:
    """One warning line per pair, with the parameters the copy adds and the fix."""
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer}
    return [f"'{second}' holds {'the transpose of ' if transposed else 'a copy of '}'{first}' ({sizes[second]:,} "
            "more trained values): the export's constant folding untied a tied weight, so both train apart; "
            "re-export with do_constant_folding=False, or freeze one in model.frozen"
            for first, second, transposed in pairs]
