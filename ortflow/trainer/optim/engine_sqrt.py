"""The engine's square root, for AdamW ``rule: engine``.

ONNX Runtime's CPU AdamW kernel computes ``sqrt(v)`` with Eigen's fast packet square root (an ``rsqrtps`` estimate
refined by one Newton step), which differs from IEEE ``sqrt`` by up to ~1 ulp; only Eigen's scalar tail (the last
``numel % PACKET`` elements of each tensor) uses the exact ``std::sqrt``. To continue runs bit for bit, ``rule: engine``
takes its square roots from the engine's own ``Sqrt`` kernel (the same Eigen code, the same instruction) through a
one-node ONNX Runtime session, called on whole packets, and uses numpy's exact sqrt for each tensor's tail. Measured on
this machine: numpy's sqrt differed from the engine's AdamW in 35 of 88 elements, this module in none
(tests/trainer/test_optim_rules.py).
"""

from __future__ import annotations

import numpy as np

#: Elements per SSE packet of float32 in the engine's Eigen build (the exact-sqrt tail is numel % PACKET).
PACKET = 4

_session = None


def _sqrt_session():
    global _session
    if _session is None:
        import onnxruntime
        from onnx import TensorProto, helper

        graph = helper.make_graph(
            [helper.make_node("Sqrt", ["v"], ["s"])], "engine_sqrt",
            [helper.make_tensor_value_info("v", TensorProto.FLOAT, [None])],
            [helper.make_tensor_value_info("s", TensorProto.FLOAT, [None])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        _session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return _session


def aligned_empty(size: int) -> np.ndarray:
    """An uninitialised float32 array whose data starts on a 64-byte boundary, as the engine's own buffers do (Eigen
    starts its packets at the first aligned element of the output, so the alignment decides which elements are
    computed by packets)."""
    raw = np.empty(size + 16, dtype=np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start : start + size]


def engine_sqrt(v: np.ndarray, lo: int, numel: int, out: np.ndarray | None = None) -> np.ndarray:
    """sqrt of ``v`` (elements ``[lo, lo + v.size)`` of a tensor of ``numel``), as the engine's AdamW computes it.

    Args:
        v: 1-D float32 second moments.
        lo: Index of ``v[0]`` in the flattened tensor (packets start at multiples of PACKET from the tensor's start).
        numel: Elements of the whole tensor.
        out: A 64-byte aligned float32 scratch (:func:`aligned_empty`) of at least ``v.size`` elements. Given, and
            the range starts on a packet and needs no padding (whole tensors always), the session reads ``v`` and
            writes ``out`` in place through IO binding: no copies.
    """
    tail = numel - numel % PACKET  # elements from here on are Eigen's scalar tail: exact sqrt
    exact_from = max(0, tail - lo)
    direct = (out is not None and out.size >= v.size and out.ctypes.data % 64 == 0 and lo % PACKET == 0
              and (v.size % PACKET == 0 or lo + v.size == numel) and v.flags.c_contiguous)
    if direct:
        result = out[: v.size]
        if v.size:
            session = _sqrt_session()
            io = session.io_binding()
            io.bind_input("v", "cpu", 0, np.float32, [v.size], v.ctypes.data)
            io.bind_output("s", "cpu", 0, np.float32, [v.size], result.ctypes.data)
            session.run_with_iobinding(io)
    else:
        shift = lo % PACKET  # pad in front so that packets start where they start in the tensor
        length = shift + v.size
        buf = np.ones(length + (-length) % PACKET, dtype=np.float32)
        buf[shift:length] = v
        result = _sqrt_session().run(None, {"v": buf})[0][shift:length]
    if exact_from < v.size:
        np.sqrt(v[exact_from:], out=result[exact_from:])
    return result
