"""Step 1 of issue 17: prove on a toy 2-stage MLP how the engine gives a pipeline stage what it needs.

Run: .venv/bin/python bench/pipeline_toy.py   (writes into a temporary folder; prints what it measured)

Stage 0: x -> h = tanh(x @ W0 + b0); its training graph's loss is sum(h * g) with the arriving gradient g an input,
so its parameter gradients are the vector-Jacobian product g . dh/dW0.
Stage 1: h -> y = h @ W1 + b1 -> MSE(y, target); its input h is listed in requires_grad, so the engine's gradient
builder emits h_grad (the gradient sent back to stage 0). Checked against the unsplit model's gradients.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortflow.config import OptimizerConfig
from ortflow.engine import api, artifacts, onnxblock
from ortflow.trainer import optim

B, D_IN, D_H, D_OUT = 4, 6, 5, 3
OPSET = [helper.make_opsetid("", 17)]


def _model(nodes, inputs, outputs, inits):
    graph = helper.make_graph(nodes, "toy", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def weights(rng):
    return {n: rng.standard_normal(s).astype(np.float32) * 0.5
            for n, s in (("W0", (D_IN, D_H)), ("b0", (D_H,)), ("W1", (D_H, D_OUT)), ("b1", (D_OUT,)))}


def stage0_nodes():
    return [helper.make_node("MatMul", ["x", "W0"], ["m0"]), helper.make_node("Add", ["m0", "b0"], ["a0"]),
            helper.make_node("Tanh", ["a0"], ["h"])]


def stage1_nodes():
    return [helper.make_node("MatMul", ["h", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["y"])]


class VJPLoss(onnxblock.Block):
    """loss = sum(h * g): the stage's parameter gradients become the VJP of the arriving gradient g."""

    def build(self, h):
        g = "h.grad_in"
        self.base.graph.input.append(_vi(g, [B, D_H]))
        self.base.graph.node.append(helper.make_node("Mul", [h, g], ["vjp.prod"]))
        self.base.graph.node.append(helper.make_node("ReduceSum", ["vjp.prod"], ["vjp.loss"], keepdims=0))
        return "vjp.loss"


def build(folder: Path, w):
    for sub in ("full", "s0", "s1"):
        (folder / sub).mkdir()
    init = lambda names: [numpy_helper.from_array(w[n], n) for n in names]  # noqa: E731
    full = _model(stage0_nodes() + stage1_nodes(), [_vi("x", [B, D_IN])], [_vi("y", [B, D_OUT])],
                  init(["W0", "b0", "W1", "b1"]))
    s0 = _model(stage0_nodes(), [_vi("x", [B, D_IN])], [_vi("h", [B, D_H])], init(["W0", "b0"]))
    s1 = _model(stage1_nodes(), [_vi("h", [B, D_H])], [_vi("y", [B, D_OUT])], init(["W1", "b1"]))
    artifacts.generate_artifacts(full, requires_grad=["W0", "b0", "W1", "b1"], loss=artifacts.LossType.MSELoss,
                                 optimizer=None, artifact_directory=folder / "full")
    artifacts.generate_artifacts(s0, requires_grad=["W0", "b0"], loss=VJPLoss(), additional_output_names=["h"],
                                 optimizer=None, artifact_directory=folder / "s0")
    # The stage input h in requires_grad: the gradient builder emits h_grad.
    artifacts.generate_artifacts(s1, requires_grad=["W1", "b1", "h"], loss=artifacts.LossType.MSELoss,
                                 optimizer=None, artifact_directory=folder / "s1")


def expose_input_grad(path: Path, name: str) -> None:
    """Turn the accumulated gradient of a stage input into a plain per-call output right after the loss.

    The engine treats every requires_grad name alike: it adds an InPlaceAccumulatorV2 and a buffer input for
    ``{name}_grad``. An input's gradient is wanted per micro-batch, not summed, so the accumulator is removed.
    """
    m = onnx.load(str(path))
    g = m.graph
    acc = next(n for n in g.node if n.op_type == "InPlaceAccumulatorV2" and n.input[1] == f"{name}_grad")
    g.node.remove(acc)
    for i in [i for i in g.input if i.name == acc.input[0]]:
        g.input.remove(i)
    outs = [o for o in g.output if o.name not in acc.output]
    # The Module returns only outputs whose names lack "_grad" (it takes those for gradients): rename through Identity.
    g.node.append(helper.make_node("Identity", [f"{name}_grad"], [f"{name}.backprop"]))
    grad_out = helper.make_tensor_value_info(f"{name}.backprop", TensorProto.FLOAT, None)
    del g.output[:]
    g.output.extend([outs[0], grad_out, *outs[1:]])
    onnx.save(m, str(path))


def module(folder: Path, name: str):
    state = api.CheckpointState.load_checkpoint(str(folder / name / "checkpoint"))
    mod = api.Module(str(folder / name / "training_model.onnx"), state, str(folder / name / "eval_model.onnx"))
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    params = [state.parameters[n].data.reshape(-1) for n in trainable]  # ortflow's AdamW on the engine's buffers
    update = optim.build_update(OptimizerConfig(), optim.whole_segments(trainable, [p.size for p in params]), params)
    grads = [state.parameters[n].grad.reshape(-1) for n in trainable]
    return state, mod, lambda: update.step(grads, OptimizerConfig().learning_rate)


def main():
    rng = np.random.default_rng(0)
    w = weights(rng)
    x = rng.standard_normal((B, D_IN)).astype(np.float32)
    t = rng.standard_normal((B, D_OUT)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, w)
        expose_input_grad(folder / "s1" / "training_model.onnx", "h")
        compare(folder, x, t)
        for name in ("s0", "s1"):
            m = onnx.load(str(folder / name / "training_model.onnx"))
            print(name, "train inputs", [i.name for i in m.graph.input], "outputs", [o.name for o in m.graph.output])
            m = onnx.load(str(folder / name / "eval_model.onnx"))
            print(name, "eval inputs", [i.name for i in m.graph.input], "outputs", [o.name for o in m.graph.output])


def compare(folder: Path, x, t, k: int = 3, steps: int = 3):
    """k micro-batches per update, ``steps`` AdamW updates: unsplit vs the two stages; returns max differences."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(x.shape).astype(np.float32) for _ in range(k * steps)]
    ts = [rng.standard_normal(t.shape).astype(np.float32) for _ in range(k * steps)]
    fs, fm, fo = module(folder, "full")
    s0s, m0, o0 = module(folder, "s0")
    s1s, m1, o1 = module(folder, "s1")
    zeros = np.zeros((B, D_H), np.float32)
    worst = {"grad": 0.0, "param": 0.0, "loss": 0.0, "h_grad_shape": None}
    for step in range(steps):
        for i in range(step * k, step * k + k):
            full_loss = fm(xs[i], ts[i])
            m0.eval()
            _, h = m0(xs[i], zeros)          # forward only: nothing kept for the backward
            m0.train()
            loss, h_grad = m1(h, ts[i])      # last stage: forward + backward in one call
            m0(xs[i], h_grad)                # recompute stage 0's forward, backward driven by h_grad
            worst["loss"] = max(worst["loss"], abs(float(full_loss) - float(loss)))
            worst["h_grad_shape"] = h_grad.shape
        for name, st in (("W0", s0s), ("b0", s0s), ("W1", s1s), ("b1", s1s)):
            diff = np.abs(fs.parameters[name].grad - st.parameters[name].grad).max()
            worst["grad"] = max(worst["grad"], float(diff))
        for step_fn, m in ((fo, fm), (o0, m0), (o1, m1)):
            step_fn()
            m.lazy_reset_grad()
        for name, st in (("W0", s0s), ("b0", s0s), ("W1", s1s), ("b1", s1s)):
            diff = np.abs(fs.parameters[name].data - st.parameters[name].data).max()
            worst["param"] = max(worst["param"], float(diff))
    print(f"max |loss diff| {worst['loss']:.3g}, max |grad diff| {worst['grad']:.3g}, "
          f"max |param diff| after {steps} AdamW updates {worst['param']:.3g}; h_grad shape {worst['h_grad_shape']}")
    return worst


if __name__ == "__main__":
    main()
