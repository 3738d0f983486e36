"""Embedding gradient on the CPU: Gather vs GatherND vs OneHot-MatMul. ``python -m bench.embedding_grad ROOT [OUT]``

The CPU engine differentiates ``Gather`` with a kernel that adds every element under one global mutex from a thread
pool, so the summation order of repeated ids follows thread timing (ortflow/graph/embedding.py). Candidates:

* ``gather``: the user's graph (``distributed.deterministic_compute: false``): the engine's GatherGrad;
* ``gathernd``: ortflow's rewrite (``deterministic_compute: true``, the default): GatherND on the unsqueezed ids,
  differentiated by the engine's single-loop GatherNDGrad;
* ``onehot``: ``MatMul(OneHot(ids, V), W)`` (written into the model file here): the gradient is a GEMM, at the cost
  of N x V x d flops and an N x V float tensor each way.

Models: the embedding alone (Gather -> weighted sum, at the demo's and the bench GPT's vocabulary, width, length and
batch), the demo GPT, and the bench GPT's vocabulary/width/length with 2 layers. Every variant is configured with
ortflow, then run in this process with 1 and 2 intra-op threads (the session always asks for the engine's
deterministic kernels, so only the graph differs); the variants take turns call by call. Reported per variant and
thread count: the median and min seconds of one forward+backward (``module(...)``, warm), and in how many steps the
``wte.weight`` gradient differed between two fresh sessions fed the same batches of tokens drawn from 0..3 (many
repeated ids). Prints one ``RESULT`` JSON line per cell and writes them to ``OUT`` (JSON) when given.
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
    # name: (GPT shape, batch size, timed rounds, repeatability steps)
    "demo": ({"vocab_size": 256, "seq_len": 16, "d_model": 64, "num_layers": 2, "num_heads": 2}, 16, 30, 40),
    "bench-2layer": ({"vocab_size": 8192, "seq_len": 256, "d_model": 768, "num_layers": 2, "num_heads": 12}, 2, 8, 3),
}
#: The embedding alone (Gather -> weighted sum, loss model_output): its fwd+bwd cost without the rest of the model.
OPS = {
    # name: (vocab, width, seq_len, batch, timed rounds, repeatability steps)
    "embedding-demo": (256, 64, 16, 16, 60, 20),
    "embedding-bench": (8192, 768, 256, 8, 40, 6),
}
THREADS = (1, 2)
#: Ops of the embedding and its gradient in the three variants (OneHot's MatMul is counted with the model's MatMuls).
EMBED_OPS = ("Gather", "GatherGrad", "GatherND", "GatherNDGrad", "Unsqueeze", "OneHot")
PROFILED_STEPS = 10
ONEHOT_ROUNDS = 6
_SHORT = {"vocab_size": "V", "seq_len": "T", "d_model": "d", "num_layers": "layers", "num_heads": "heads"}


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


def embedding_model(path: Path, vocab: int, width: int, seq_len: int) -> Path:
    """input_ids [B, T] -> Gather(wte.weight) -> x c (fixed [T, d] values) -> ReduceSum: the loss is the output.

    ``c`` differs by position, so a repeated id gets different gradient rows (equal addends would sum alike in any
    order and hide a varying order)."""
    rng = np.random.default_rng(0)
    table = helper.make_tensor("wte.weight", onnx.TensorProto.FLOAT, [vocab, width],
                               (rng.standard_normal((vocab, width)) * 0.02).astype(np.float32).ravel())
    weights = helper.make_tensor("c", onnx.TensorProto.FLOAT, [seq_len, width],
                                 rng.standard_normal((seq_len, width)).astype(np.float32).ravel())
    nodes = [
        helper.make_node("Constant", [], ["c.value"], value=weights),
        helper.make_node("Gather", ["wte.weight", "input_ids"], ["emb"], name="wte", axis=0),
        helper.make_node("Mul", ["emb", "c.value"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "embedding", [helper.make_tensor_value_info(
        "input_ids", onnx.TensorProto.INT64, ["batch", seq_len])],
        [helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, [])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def configure_variant(root: Path, model: Path, variant: str, batch: int, loss: str) -> Path:
    from ortflow.build.configure import configure
    from ortflow.config import config_from_dict

    if variant == "onehot":
        model = onehot_model(model, root / "onehot.onnx")
    cfg = config_from_dict({
        "output_dir": str(root / variant), "model": {"path": str(model), "loss": loss,
                  "loss_output": "loss" if loss == "model_output" else None},
        "data": {"train": [str(root / "unused.npz")]}, "train": {"batch_size": batch, "num_train_steps": 1},
        "distributed": {"deterministic_compute": variant == "gathernd"},
    })  # fmt: skip
    configure(cfg)
    ops = {n.op_type for n in onnx.load(str(cfg.artifacts_dir / "eval_model.onnx")).graph.node}
    expected = {"gather": "Gather", "gathernd": "GatherND", "onehot": "OneHot"}[variant]
    if expected not in ops:
        raise RuntimeError(f"variant {variant}: no {expected} in the eval model")
    return cfg.artifacts_dir


def session(artifacts: Path, threads: int, profile: str | None = None):
    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options

    options = session_options(threads, True)
    if profile:
        options.enable_profiling, options.profile_file_prefix = True, profile
    state = api.CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    module = api.Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"),
                        device="cpu", session_options=options)
    module.train()
    return state, module


def batches(seq_len: int, batch: int, high: int, count: int, seed: int, labels: bool) -> list[tuple]:
    """``count`` feeds: (ids,) or (ids, next-token labels flattened) with ids drawn from 0..high-1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, high, (batch, seq_len + 1), dtype=np.int64)
        ids = tokens[:, :-1].copy()
        out.append((ids, tokens[:, 1:].reshape(-1).copy()) if labels else (ids,))
    return out


def interleaved_times(arts: dict[str, Path], threads: int, feeds: list[tuple]) -> dict[str, list[float]]:
    """Seconds of one fwd+bwd per variant, the variants taking turns each round (a shared machine's load then
    falls on all alike); one warm-up call each first."""
    modules = {v: session(a, threads)[1] for v, a in arts.items()}
    for module in modules.values():
        module(*feeds[0])
        module.lazy_reset_grad()
    seconds: dict[str, list[float]] = {v: [] for v in arts}
    for r, feed in enumerate(feeds):
        order = list(arts)[r % len(arts):] + list(arts)[:r % len(arts)]
        for variant in order:
            if variant == "onehot" and r >= ONEHOT_ROUNDS:  # seconds per call at the bench size: a few suffice
                continue
            start = time.perf_counter()
            modules[variant](*feed)
            seconds[variant].append(time.perf_counter() - start)
            modules[variant].lazy_reset_grad()
    return seconds


def differing_steps(artifacts: Path, threads: int, feeds: list[tuple]) -> int:
    """Steps whose wte.weight gradient differs between two fresh sessions fed the same batches."""
    runs = []
    for _ in range(2):
        state, module = session(artifacts, threads)
        grads = []
        for feed in feeds:
            module.lazy_reset_grad()
            module(*feed)
            grads.append(np.array(state.parameters["wte.weight"].grad).tobytes())
        runs.append(grads)
    return sum(a != b for a, b in zip(*runs, strict=True))


def kernel_ms(artifacts: Path, threads: int, feeds: list[tuple]) -> dict[str, float]:
    """ms per step inside the embedding's kernels (EMBED_OPS) and in all kernels, from the engine's own profiler:
    each node's median call, summed (kernel times only: a shared machine's load inflates them less than wall-clock
    times, and the first call's warm-up drops out)."""
    prefix = str(artifacts.parent / f"profile-{threads}-")
    _, module = session(artifacts, threads, prefix)
    for feed in feeds:
        module(*feed)
        module.lazy_reset_grad()
    del module  # the profile is written when the session ends
    # The Module's training and eval sessions each write a profile: the training one is the big one.
    files = sorted(artifacts.parent.glob("profile-*.json"), key=lambda f: f.stat().st_size)
    path = files[-1]
    calls: dict[tuple[str, str], list[float]] = {}  # (op, node) -> ms of each call
    for event in json.loads(path.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"]["op_name"]
            op = f"onehot:{op}" if event["name"].startswith("onehot") else op  # the one-hot MatMul and its gradient
            calls.setdefault((op, event["name"]), []).append(event["dur"] / 1e3)
    per_op: dict[str, float] = {}
    for (op, _), values in calls.items():  # each node's median call: the first call's warm-up does not count
        per_op[op] = per_op.get(op, 0.0) + statistics.median(values)
    for f in files:
        f.unlink()
    embed = {op: round(ms, 3) for op, ms in per_op.items() if op in EMBED_OPS or op.startswith("onehot:")}
    return {**embed, "embedding_total": round(sum(embed.values()), 3), "all_kernels": round(sum(per_op.values()), 2)}


def measure(name: str, meta: dict, arts: dict[str, Path], timing: list[tuple], repeat: list[tuple]) -> list[dict]:
    cells = []
    for threads in THREADS:
        seconds = interleaved_times(arts, threads, timing)
        for variant, values in seconds.items():
            cell = {"model": name, **meta, "variant": variant, "threads": threads,
                    "fwd_bwd_s_median": round(statistics.median(values), 5), "fwd_bwd_s_min": round(min(values), 5),
                    "rounds": len(values), "repeat_steps": len(repeat),
                    "differing_steps": differing_steps(arts[variant], threads, repeat),
                    "kernel_ms_per_step": kernel_ms(arts[variant], threads, timing[:PROFILED_STEPS])}
            cells.append(cell)
            print("RESULT " + json.dumps(cell), flush=True)
    return cells


def main(root: Path, out: Path | None) -> None:
    from ortflow.examples.gpt import build_gpt

    results = []
    variants = ("gather", "gathernd", "onehot")
    for name, (vocab, width, seq_len, batch, rounds, repeat_steps) in OPS.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        model = embedding_model(folder / "embedding.onnx", vocab, width, seq_len)
        arts = {v: configure_variant(folder, model, v, batch, "model_output") for v in variants}
        meta = {"shape": {"vocab_size": vocab, "d_model": width, "seq_len": seq_len}, "batch_size": batch}
        results += measure(name, meta, arts, batches(seq_len, batch, vocab, rounds, 1, False),
                           batches(seq_len, batch, 4, repeat_steps, 2, False))
    for name, (shape, batch, rounds, repeat_steps) in MODELS.items():
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        model = build_gpt(folder / "gpt.onnx", **shape)
        arts = {v: configure_variant(folder, model, v, batch, "cross_entropy") for v in variants}
        seq_len, vocab = shape["seq_len"], shape["vocab_size"]
        results += measure(name, {"shape": shape, "batch_size": batch}, arts,
                           batches(seq_len, batch, vocab, rounds, 1, True),
                           batches(seq_len, batch, 4, repeat_steps, 2, True))
    if out is not None:
        out.write_text(json.dumps(results, indent=1))
        command = " ".join([".venv/bin/python -m bench.embedding_grad", *sys.argv[1:]])
        out.with_suffix(".md").write_text(markdown(results, command))


def markdown(results: list[dict], command: str) -> str:
    """One table: per model and thread count, each variant's median (min) ms and differing steps."""
    lines = [f"# Embedding gradient on the CPU: Gather vs GatherND vs OneHot-MatMul\n\n`{command}`\n",
             "fwd+bwd ms, median (min) over interleaved calls (onehot: its first 6 rounds); differing: steps whose "
             "wte.weight gradient differed "
             "between two fresh sessions on the same batches of ids from 0..3; embedding kernels: ms per step inside "
             "the embedding's kernels (Gather+GatherGrad, GatherND+GatherNDGrad+Unsqueeze, OneHot+its MatMul and "
             "gradient), from the engine's profiler, and in all kernels.\n",
             "| model | shape, batch | threads | gather | gathernd | onehot | differing (gather / gathernd / onehot) "
             "| embedding kernels (gather / gathernd / onehot) | all kernels (gather / gathernd / onehot) |",
             "|---|---|---|---|---|---|---|---|---|"]
    cells = {(r["model"], r["threads"], r["variant"]): r for r in results}
    for (model, threads) in dict.fromkeys((r["model"], r["threads"]) for r in results):
        row = [cells[(model, threads, v)] for v in ("gather", "gathernd", "onehot")]
        times = [f"{r['fwd_bwd_s_median'] * 1e3:.2f} ({r['fwd_bwd_s_min'] * 1e3:.2f})" for r in row]
        differing = " / ".join(f"{r['differing_steps']}/{r['repeat_steps']}" for r in row)
        shape = ", ".join(f"{_SHORT[k]} {v}" for k, v in row[0]["shape"].items())
        embed = " / ".join(f"{r['kernel_ms_per_step']['embedding_total']:.3f}" for r in row)
        total = " / ".join(f"{r['kernel_ms_per_step']['all_kernels']:.1f}" for r in row)
        lines.append(f"| {model} | {shape}; batch {row[0]['batch_size']} | {threads} | {' | '.join(times)} | "
                     f"{differing} | {embed} | {total} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
