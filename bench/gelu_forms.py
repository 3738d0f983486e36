"""GELU formulations on the engine's CPU kernels: forward+backward cost per element of each, in one process.

Each candidate is a tiny training graph ``y = GELU(x + b)`` (``x`` a ``[rows, width]`` input, ``b`` a trained bias,
loss ``sum(y * r)`` for a fixed random ``r``), built by the engine's own artifact generator (so its graph optimizer
fuses whatever it fuses when it builds a training graph). The steps of all candidates alternate (order reversed every
other round) and are timed with the calling thread's CPU time at one intra-op thread, or wall time with more. The
``identity`` candidate (``y = x + b``) is the floor: a candidate's GELU cost is its step minus the floor's, per
element. Also reported: the kernels each training graph runs, and the largest gradient error against float64.

    python -m bench.gelu_forms --rows 2048 --width 1024 --rounds 30 --threads 1 --out bench/results
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.graph.gelu_grad import SIGMOID_A, SIGMOID_B, fast_gelu_nodes

C = math.sqrt(2.0 / math.pi)
K = 0.044715


def _const(name: str, value: float) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.FLOAT, [], [value]))


def candidates() -> dict[str, list[onnx.NodeProto]]:
    """Nodes computing ``y`` from ``h`` for each formulation (names local to one graph)."""
    ms = "com.microsoft"
    forms: dict[str, list[onnx.NodeProto]] = {"identity": [helper.make_node("Identity", ["h"], ["y"])]}
    forms["FastGelu (engine's tanh)"] = [helper.make_node("FastGelu", ["h"], ["y"], domain=ms)]
    forms["Gelu (engine's erf)"] = [helper.make_node("Gelu", ["h"], ["y"], domain=ms)]
    forms["FastGelu(x, bias)"] = [helper.make_node("FastGelu", ["x", "b"], ["y"], domain=ms)]
    forms["BiasGelu(x, bias) (erf)"] = [helper.make_node("BiasGelu", ["x", "b"], ["y"], domain=ms)]
    forms["gelu_new as exported (Pow)"] = [
        _const("three", 3.0), _const("k", K), _const("c", C), _const("one", 1.0), _const("half", 0.5),
        helper.make_node("Pow", ["h", "three"], ["p"]), helper.make_node("Mul", ["k", "p"], ["kp"]),
        helper.make_node("Add", ["h", "kp"], ["s"]), helper.make_node("Mul", ["c", "s"], ["z"]),
        helper.make_node("Tanh", ["z"], ["t"]), helper.make_node("Add", ["one", "t"], ["g"]),
        helper.make_node("Mul", ["half", "h"], ["hh"]), helper.make_node("Mul", ["hh", "g"], ["y"]),
    ]  # fmt: skip
    forms["tanh, h * (0.5 + 0.5 tanh(h (c + ck h^2)))"] = [
        _const("a", C), _const("bb", C * K), _const("half", 0.5),
        helper.make_node("Mul", ["h", "h"], ["h2"]), helper.make_node("Mul", ["h2", "bb"], ["u"]),
        helper.make_node("Add", ["u", "a"], ["v"]), helper.make_node("Mul", ["h", "v"], ["z"]),
        helper.make_node("Tanh", ["z"], ["t"]), helper.make_node("Mul", ["t", "half"], ["t2"]),
        helper.make_node("Add", ["t2", "half"], ["g"]), helper.make_node("Mul", ["h", "g"], ["y"]),
    ]  # fmt: skip
    forms["sigmoid, h * sigmoid(h (2c + 2ck h^2)) (ortflow)"] = fast_gelu_nodes("h", "y", _names())
    forms["sigmoid, h * sigmoid(2c h + 2ck h^3) with Pow"] = [
        _const("a", SIGMOID_A), _const("bb", SIGMOID_B), _const("three", 3.0),
        helper.make_node("Pow", ["h", "three"], ["p"]), helper.make_node("Mul", ["p", "bb"], ["u"]),
        helper.make_node("Mul", ["h", "a"], ["w"]), helper.make_node("Add", ["w", "u"], ["z"]),
        helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["h", "s"], ["y"]),
    ]  # fmt: skip
    forms["erf as exported, h * ((erf(h / sqrt2) + 1) * 0.5)"] = [
        _const("r2", 1 / math.sqrt(2.0)), _const("one", 1.0), _const("half", 0.5),
        helper.make_node("Mul", ["h", "r2"], ["q"]), helper.make_node("Erf", ["q"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["g"]), helper.make_node("Mul", ["g", "half"], ["gh"]),
        helper.make_node("Mul", ["h", "gh"], ["y"]),
    ]  # fmt: skip
    return forms


class _names:
    """Fresh names for the nodes ortflow's pass writes (the bench graph has no clashes to avoid)."""

    def __init__(self):
        self.count = 0

    def new(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"


def model_for(nodes: list[onnx.NodeProto], width: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    bias = numpy_helper.from_array(rng.normal(0, 0.5, width).astype(np.float32), "b")
    r = numpy_helper.from_array(rng.normal(0, 1, width).astype(np.float32), "r")
    uses_h = any("h" in n.input for n in nodes)
    head = [helper.make_node("Add", ["x", "b"], ["h"])] if uses_h else []
    tail = [helper.make_node("Mul", ["y", "r"], ["yr"]), helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        [*head, *nodes, *tail], "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", width])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [bias, r])  # fmt: skip
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def build(folder: Path, model: onnx.ModelProto):
    from ortflow.engine import artifacts, onnxblock

    class Loss(onnxblock.Block):
        def build(self, name):  # the model's output is the loss already
            return name

    folder.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(folder)  # generate_artifacts may write temp.onnx into the working folder
    try:
        artifacts.generate_artifacts(model, requires_grad=["b"], frozen_params=["r"], loss=Loss(),
                                     artifact_directory=str(folder))
    finally:
        os.chdir(cwd)
    ops = sorted({n.op_type for n in onnx.load(str(folder / "training_model.onnx")).graph.node})
    return ops


def module(folder: Path, threads: int):
    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options

    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    m = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                   session_options=session_options(threads))
    m.train()
    return m, state


def reference_grad(kind: str, x: np.ndarray, b: np.ndarray, r: np.ndarray) -> np.ndarray:
    """d loss / d b in float64 for the tanh or erf GELU."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    h = x.astype(np.float64) + b.astype(np.float64)
    if kind == "erf":
        d = 0.5 * (1 + erf(h / math.sqrt(2))) + h * np.exp(-h * h / 2) / math.sqrt(2 * math.pi)
    else:
        t = np.tanh(C * (h + K * h**3))
        d = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * C * (1 + 3 * K * h * h)
    return (d * r.astype(np.float64)).sum(axis=0)


def main(argv: list[str] | None = None) -> None:
    from bench.common import host_info, write_result

    parser = argparse.ArgumentParser(prog="python -m bench.gelu_forms")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="", help="comma list of substrings of candidate names")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    forms = candidates()
    if args.only:
        keep = args.only.split(",")
        forms = {k: v for k, v in forms.items() if k == "identity" or any(s in k for s in keep)}
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1.5, (args.rows, args.width)).astype(np.float32)
    mods, ops, errors = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, nodes) in enumerate(forms.items()):
            model = model_for(nodes, args.width)
            ops[name] = build(Path(tmp) / str(i), model)
            mods[name] = module(Path(tmp) / str(i), args.threads)
        b = numpy_helper.to_array(model.graph.initializer[0])
        r = numpy_helper.to_array(model.graph.initializer[1])
        for name, (m, state) in mods.items():
            m(x)
            grad = state.parameters["b"].grad.copy()
            m.lazy_reset_grad()
            if name != "identity":
                ref = reference_grad("erf" if "erf" in name.lower() or "BiasGelu" in name else "tanh", x, b, r)
                errors[name] = float(np.abs(grad - ref).max() / np.abs(ref).max())
        load_start = os.getloadavg()
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        times: dict[str, list[float]] = {k: [] for k in mods}
        names = list(mods)
        for rnd in range(args.rounds + 2):
            for name in names if rnd % 2 == 0 else names[::-1]:
                m = mods[name][0]
                t0 = clock()
                m(x)
                m.lazy_reset_grad()
                if rnd >= 2:
                    times[name].append(clock() - t0)
    n = args.rows * args.width
    floor = np.median(times["identity"])
    rows = {name: {"ms_median": float(np.median(t) * 1e3), "ms_min": float(np.min(t) * 1e3),
                   "gelu_ns_per_element": float((np.median(t) - floor) / n * 1e9), "ops": ops[name],
                   "rel_grad_error_vs_float64": errors.get(name)} for name, t in times.items()}  # fmt: skip
    record = {"rows": args.rows, "width": args.width, "threads": args.threads, "rounds": args.rounds,
              "load_avg": [load_start, os.getloadavg()], "host": host_info(), "candidates": rows,
              "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    lines = [f"# GELU formulations on the engine's CPU kernels ({record['time']})", "",
             "```", f"python -m bench.gelu_forms --rows {args.rows} --width {args.width} --rounds {args.rounds} "
             f"--threads {args.threads}", "```", "",
             f"CPU {record['host']['cpu']}, commit {record['host']['commit']}, onnxruntime "
             f"{record['host']['versions']['onnxruntime']}, onnx {record['host']['versions']['onnx']}; tensor "
             f"{args.rows} x {args.width} = {n} elements; {args.threads} intra-op thread(s) "
             f"({'thread CPU time' if args.threads == 1 else 'wall time'}); load average at start / end "
             f"{load_start[0]:.1f} / {record['load_avg'][1][0]:.1f}.", "",
             "| formulation | fwd+bwd ms median (min) | GELU ns/element (minus identity) | grad error vs float64 | "
             "GELU kernels in the training graph |", "|---|---|---|---|---|"]  # fmt: skip
    for name, row in rows.items():
        err = row["rel_grad_error_vs_float64"]
        kernels = [o for o in row["ops"] if o not in {"Add", "Mul", "ReduceSum", "Constant", "Identity", "Shape",
                                                        "Expand", "Reshape", "Unsqueeze", "Squeeze"}]  # fmt: skip
        lines.append(f"| {name} | {row['ms_median']:.2f} ({row['ms_min']:.2f}) | {row['gelu_ns_per_element']:.2f} | "
                     f"{'-' if err is None else f'{err:.1e}'} | {', '.join(kernels)} |")
    write_result(args.out, f"gelu-forms-{args.threads}t", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
