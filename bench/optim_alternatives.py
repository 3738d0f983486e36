"""Ways to run AdamW ``rule: torch`` on the CPU that bench.optim_cpu measures beside ortflow's backends.

Each builder takes the parameter views, gradient views and thread count and returns ``step(lr, t)``; each keeps its
own moments. They perform the rule's float32 operations in its order (bench.optim_cpu checks which give its bits):

- numexpr: three multithreaded one-expression passes (moments, second moments, parameters), each written in place.
- Numba ``parallel``: one loop per tensor split over Numba's own thread pool (``prange``).
- ONNX Runtime: the rule as an ONNX graph (Mul/Add/Sqrt/Div/Sub) run by an InferenceSession with IO binding onto the
  same buffers (inputs and outputs bound to the parameter, gradient and moment memory; no copies). ORT's ``Sqrt`` is
  Eigen's fast approximate square root, so this one cannot give the numpy rule's bits.
"""

from __future__ import annotations

import math

import numpy as np

f32 = np.float32


def torch_consts(lr: float, t: int, b1=0.9, b2=0.999, eps=1e-8, wd=0.01) -> tuple:
    """(keep, c1, b1, c2, b2, eps_hat, step_size) as ortflow's AdamW torch rule computes them."""
    bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
    return (f32(1.0 - lr * wd), f32(1.0 - b1), f32(b1), f32(1.0 - b2), f32(b2), f32(eps * math.sqrt(bc2)),
            f32(lr * math.sqrt(bc2) / bc1))


def numexpr_adamw(params, grads, threads: int):
    import numexpr

    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]

    def step(lr: float, t: int) -> None:
        numexpr.set_num_threads(threads)
        keep, c1, b1, c2, b2, eps_hat, step_size = torch_consts(lr, t)
        for p, g, mi, vi in zip(params, grads, m, v, strict=True):
            names = {"p": p, "g": g, "m": mi, "v": vi, "keep": keep, "c1": c1, "b1": b1, "c2": c2, "b2": b2,
                     "eps_hat": eps_hat, "step_size": step_size}
            numexpr.evaluate("m * b1 + g * c1", local_dict=names, out=mi, casting="no")
            numexpr.evaluate("v * b2 + (g * g) * c2", local_dict=names, out=vi, casting="no")
            numexpr.evaluate("p * keep - (m / (sqrt(v) + eps_hat)) * step_size", local_dict=names, out=p,
                             casting="no")

    return step


_prange_kernel = None


def numba_parallel_adamw(params, grads, threads: int):
    global _prange_kernel
    import numba

    if _prange_kernel is None:
        @numba.njit(parallel=True, cache=True)
        def kernel(p, g, m, v, keep, c1, b1, c2, b2, eps_hat, step_size):  # pragma: no cover - compiled
            for i in numba.prange(p.size):
                gi = g[i]
                mi = m[i] * b1 + gi * c1
                vi = v[i] * b2 + (gi * gi) * c2
                m[i] = mi
                v[i] = vi
                p[i] = p[i] * keep - (mi / (math.sqrt(vi) + eps_hat)) * step_size

        _prange_kernel = kernel
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]

    def step(lr: float, t: int) -> None:
        numba.set_num_threads(threads)
        consts = torch_consts(lr, t)
        for p, g, mi, vi in zip(params, grads, m, v, strict=True):
            _prange_kernel(p, g, mi, vi, *consts)

    return step


def _adamw_graph():
    from onnx import TensorProto, helper

    scalars = ["keep", "c1", "b1", "c2", "b2", "eps_hat", "step_size"]
    nodes = [
        helper.make_node("Mul", ["p", "keep"], ["pk"]),
        helper.make_node("Mul", ["m", "b1"], ["mb"]), helper.make_node("Mul", ["g", "c1"], ["gc"]),
        helper.make_node("Add", ["mb", "gc"], ["m_out"]),
        helper.make_node("Mul", ["g", "g"], ["gg"]), helper.make_node("Mul", ["gg", "c2"], ["ggc"]),
        helper.make_node("Mul", ["v", "b2"], ["vb"]), helper.make_node("Add", ["vb", "ggc"], ["v_out"]),
        helper.make_node("Sqrt", ["v_out"], ["root"]), helper.make_node("Add", ["root", "eps_hat"], ["den"]),
        helper.make_node("Div", ["m_out", "den"], ["q"]), helper.make_node("Mul", ["q", "step_size"], ["u"]),
        helper.make_node("Sub", ["pk", "u"], ["p_out"]),
    ]
    vec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in ("p", "g", "m", "v")]
    sca = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in scalars]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in ("p_out", "m_out", "v_out")]
    graph = helper.make_graph(nodes, "adamw_torch", vec + sca, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), scalars


def onnxruntime_adamw(params, grads, threads: int):
    import onnxruntime

    model, scalars = _adamw_graph()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    consts = np.zeros(len(scalars), dtype=np.float32)  # bound once by address; rewritten every step
    bindings = []
    for p, g, mi, vi in zip(params, grads, m, v, strict=True):
        io = session.io_binding()
        for name, arr in (("p", p), ("g", g), ("m", mi), ("v", vi)):
            io.bind_input(name, "cpu", 0, np.float32, [arr.size], arr.ctypes.data)
        for k, name in enumerate(scalars):
            io.bind_input(name, "cpu", 0, np.float32, [], consts.ctypes.data + 4 * k)
        for name, arr in (("p_out", p), ("m_out", mi), ("v_out", vi)):  # in place: outputs onto the inputs' memory
            io.bind_output(name, "cpu", 0, np.float32, [arr.size], arr.ctypes.data)
        bindings.append(io)

    def step(lr: float, t: int) -> None:
        consts[:] = torch_consts(lr, t)
        for io in bindings:
            session.run_with_iobinding(io)

    step.keep_alive = (session, m, v, consts)  # the bindings point into these
    return step
