"""Embedding gradient on the CPU: Gather vs GatherND vs OneHot-MatMul. ``python -m bench.embedding_grad ROOT [OUT]``

The CPU engine differentiates ``Gather`` with a kernel that adds every element under one global mutex from a thread
pool, so the summation order of repeated ids follows thread timing (ortflow/graph/embedding.py). Candidates:

* ``gather``: the user's graph (``distributed.deterministic_compute: false``): the engine's GatherGrad;
* ``gathernd``: ortflow's rewrite (``deterministic_compute: true``, the default): GatherND on the unsqueezed ids,
  differentiated by the engine's single-loop GatherNDGrad;
* ``onehot``: ``MatMul(OneHot(ids, V), W)`` (written into the model file here): the gradient is a GEMM, at the cost
  of N x V x d flops and an N x V float tensor each way.

For each model (the demo GPT and the bench GPT's vocabulary/width/length with 2 layers) every variant is configured
with ortflow, then trained in this process with 1 and 2 intra-op threads (the session always asks for the engine's
deterministic kernels, so only the graph differs). Reported per variant and thread count: the median seconds of one
forward+backward (``module(...)``, warm), and whether the embedding gradient was bitwise the same in two sessions
over the same batches of tokens drawn from 0..3 (many repeated ids). Prints one ``RESULT`` JSON line per cell and
writes them to ``OUT`` (JSON) when given.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

MODELS = {
    "demo": ({"vocab_size": 256, "seq_len": 16, "d_model": 64, "num_layers": 2, "num_heads": 2}, 16, 30),
    "bench-2layer": ({"vocab_size": 8192, "seq_len": 256, "d_model": 768, "num_layers": 2, "num_heads": 12}, 4, 4),
}  # shape, batch size, timed steps
THREADS = (1, 2)
REPEAT_STEPS = 4


def onehot_model(src: Path, dst: Path) -> Path:
    """``src`` with its Gather on ``wte.weight`` written as MatMul(OneHot(ids, V), wte.weight)."""
    model = onnx.load(str(src))
    vocab = next(t.dims[0] for t in model.graph.initializer if t.name == "wte.weight")
    nodes = []
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[0] == "wte.weight":
            depth = helper.make_tensor("onehot.depth", onnx.TensorProto.INT64, [], [vocab])
            values = helper.make_tensor("onehot.values", onnx.TensorProto.FLOAT, [2], [0.0, 1.0])
            nodes += [
                helper.make_node("Constant", [], ["onehot.depth"], value=depth),
                helper.make_node("Constant", [], ["onehot.values"], value=values),
                helper.make_node("OneHot", [node.input[1], "onehot.depth", "onehot.values"], ["onehot.out"], axis=-1),
                helper.make_node("MatMul", ["onehot.out", "wte.weight"], list(node.output), name="onehot.mm"),
            ]
        else:
            nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(dst))
    return dst


def configure_variant(root: Path, model: Path, variant: str, batch: int) -> Path:
    from ortflow.config import config_from_dict
    from ortflow.configure import configure

    if variant == "onehot":
        model = onehot_model(model, root / "onehot.onnx")
    cfg = config_from_dict({
        "output_dir": str(root / variant), "model": {"path": str(model), "loss": "cross_entropy"},
        "data": {"train": [str(root / "unused.npz")]}, "train": {"batch_size": batch, "num_train_steps": 1},
        "distributed": {"deterministic_compute": variant == "gathernd"},
    })  # fmt: skip
    configure(cfg)
    ops = {n.op_type for n in onnx.load(str(cfg.artifacts_dir / "eval_model.onnx")).graph.node}
    expected = {"gather": "Gather", "gathernd": "GatherND", "onehot": "OneHot"}[variant]
    if expected not in ops:
        raise RuntimeError(f"variant {variant}: no {expected} in the eval model")
    return cfg.artifacts_dir


def session(artifacts: Path, threads: int):
    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options

    state = api.CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    module = api.Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"),
                        device="cpu", session_options=session_options(threads, True))
    module.train()
    if module.input_names() != ["input_ids", "labels"]:
        raise RuntimeError(f"unexpected training inputs {module.input_names()}")
    return state, module


def batches(shape: dict, batch: int, high: int, count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, high, (batch, shape["seq_len"] + 1), dtype=np.int64)
        out.append((tokens[:, :-1].copy(), tokens[:, 1:].reshape(-1).copy()))
    return out


def time_steps(artifacts: Path, threads: int, data: list) -> list[float]:
    _, module = session(artifacts, threads)
    module(*data[0])  # warm-up: allocations, first-run kernels
    seconds = []
    for ids, labels in data:
        start = time.perf_counter()
        module(ids, labels)
        seconds.append(time.perf_counter() - start)
        module.lazy_reset_grad()
    return seconds


def embedding_grads(artifacts: Path, threads: int, data: list) -> list[bytes]:
    state, module = session(artifacts, threads)
    grads = []
    for ids, labels in data:
        module.lazy_reset_grad()
        module(ids, labels)
        grads.append(np.array(state.parameters["wte.weight"].grad).tobytes())
    return grads


def main(root: Path, out: Path | None) -> None:
    from ortflow.examples.gpt import build_gpt

    results = []
    for name, (shape, batch, steps) in MODELS.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        model = build_gpt(folder / "gpt.onnx", **shape)
        arts = {v: configure_variant(folder, model, v, batch) for v in ("gather", "gathernd", "onehot")}
        timing_data = batches(shape, batch, shape["vocab_size"], steps, seed=1)
        repeat_data = batches(shape, batch, 4, REPEAT_STEPS, seed=2)
        for threads in THREADS:
            for variant, artifacts in arts.items():
                seconds = time_steps(artifacts, threads, timing_data)
                first, second = (embedding_grads(artifacts, threads, repeat_data) for _ in range(2))
                cell = {"model": name, "shape": shape, "batch_size": batch, "variant": variant, "threads": threads,
                        "fwd_bwd_s_median": statistics.median(seconds), "fwd_bwd_s_min": min(seconds),
                        "steps": len(seconds),
                        "wte_grad_repeatable": first == second,
                        "differing_steps": sum(a != b for a, b in zip(first, second, strict=True))}
                results.append(cell)
                print("RESULT " + json.dumps(cell), flush=True)
    if out is not None:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
