"""The engine's training call against its separate forward and backward calls, on one CPU process.

Run: ``python -m bench engine-calls [--reps 5] [--micro 2] [--stage-options]`` (writes ``bench/out/engine-
calls-<host>.json`` and ``.md``). For the committed GPT-2 export (``tests/fixtures/exports/gpt2.onnx``, 8 windows of
32 tokens per micro-batch) and the bench GPT (``ortflow.examples.gpt`` at the suite's shape: vocab 256, T 128, d 256,
4 layers; 8 sequences per micro-batch), one unsplit run folder each is configured; then each contender runs in its
own process, 1 thread:

* ``training_call``: the trainer's call (``api.Module`` in train mode; the engine sums gradients in its buffers);
* ``forward_backward``: ``ortflow.engine.ForwardBackward`` over the eval model (forward, then backward fed the loss
  gradient 1; ortflow copies the first micro-batch's gradients into the same buffers and adds the others).

Reported: median seconds per update of ``--micro`` micro-batches over ``--reps`` repetitions after one warm-up, the
peak resident memory growth over the calls (``VmHWM`` after resetting it, above the started sessions), and whether
the summed gradients are bitwise equal (else the largest difference relative to the largest gradient).

``--device cuda`` runs both contenders on GPU 0 (the GPU engine and CuPy): the parameters enter the forward as the
engine's own device tensors, the gradients stay on the GPU and are summed there with CuPy, and the separate calls run
as a CUDA pipeline stage or tensor-parallel piece runs them (``ortflow.trainer.parallel.kept_activations``): their
session computes on a stream the process owns (``EngineStream``, the CUDA provider's user compute stream), the sums
are queued behind the backward on that stream, and the host waits for the stream once after each call (where a stage
reads what the call wrote); ``--nondeterministic`` turns the engine's deterministic compute off in both contenders'
sessions. The memory column is then
the GPU memory taken over the calls (used memory after them minus before them: the engine's arena keeps its peak),
and a third model, ``gpt_1024`` (d 1024, 8 layers, vocab 8192, T 256; 8 sequences per micro-batch), shows a size
where the GPU is busy rather than waiting on launches. Where configure rewrites the training graph's leading-axis
sums as MatMuls (``device: cuda`` with deterministic compute), the forward+backward contender's gradient graph has
its sums rewritten the same way, as a CUDA rank's kept stage or piece has (the table's last column counts them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write_result

ROOT = Path(__file__).resolve().parents[1]
BENCH_GPT = {"vocab_size": 256, "seq_len": 128, "d_model": 256, "num_layers": 4, "num_heads": 4}
GPT_1024 = {"vocab_size": 8192, "seq_len": 256, "d_model": 1024, "num_layers": 8, "num_heads": 16}
METHODS = ("training_call", "forward_backward")


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _configure(root: Path, name: str, micro: int, device: str, deterministic: bool = True):
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data
    from ortflow.examples.gpt import build_gpt

    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ortflow").rglob("*.py"))[:60]))
    if name == "gpt2":
        model, seq, text = ROOT / "tests" / "fixtures" / "exports" / "gpt2.onnx", 32, {"input_name": "input_ids"}
    else:
        shape = GPT_1024 if name == "gpt_1024" else BENCH_GPT
        model, seq, text = root / f"{name}.onnx", shape["seq_len"], {}
        if not model.exists():
            build_gpt(model, **shape)
    cfg = config_from_dict({
        "name": name, "output_dir": str(root / name), "model": {"path": str(model)},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": seq, **text}, "eval_fraction": 0.02},
        "train": {"batch_size": 8, "gradient_accumulation_steps": micro, "num_train_steps": micro},
        "optimizer": {"learning_rate": 1e-3},
        "distributed": {"device": device, "use_nccl": device == "cuda",
                        **({} if device == "cpu" else {"deterministic_compute": deterministic})},
    })
    configure(cfg)
    prepare_data(cfg)
    return cfg.output_dir


def _gpu_used() -> int:
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def worker(run_dir: Path, method: str, reps: int, micro: int, grads_out: Path, stage_options: bool,
           device: str = "cpu", deterministic: bool = True) -> None:
    """One contender in this process: warm-up + ``reps`` updates of ``micro`` micro-batches; prints one JSON line."""
    from ortflow.config import load_run_config
    from ortflow.configure.training_graph import sums_as_matmul_applies
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.engine import ForwardBackward, api
    from ortflow.graph.gradients.leading_sums import LeadingSumReport
    from ortflow.trainer.comm.engine_buffers import HostBuffers
    from ortflow.trainer.parallel.pipeline_stage import stage_session_options
    from ortflow.trainer.startup import session_options

    def options():
        if stage_options:
            return stage_session_options(1, HostBuffers(), deterministic)
        return session_options(1, deterministic)

    cuda = device == "cuda"
    cfg = load_run_config(run_dir)
    sums = LeadingSumReport()
    sums_rewritten = None  # the training call's graph: configure's record
    folder = cfg.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        device=device, session_options=options())
    module.train()
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    batches = [loader.batch(0, i) for i in range(micro)]
    if method == "training_call":
        names = module.input_names()

        def update() -> None:
            module.lazy_reset_grad()
            for batch in batches:
                module(*(batch[n] for n in names))

        def gradients() -> list[np.ndarray]:
            return [np.array(state.parameters[n].grad) for n in trainable]  # host copies on CUDA
    else:
        providers = ["CPUExecutionProvider"]
        if cuda:  # the rank's stream: the engine computes on it and the sums are queued behind the backward
            import cupy

            from ortflow.trainer.comm.nccl import DeviceBuffer, EngineStream

            stream = EngineStream(cupy, 0)
            providers = [("CUDAExecutionProvider", stream.provider_options()), "CPUExecutionProvider"]
        rewrite = None
        if sums_as_matmul_applies(cfg):  # as a CUDA rank rewrites a kept stage's or piece's gradient graph
            from ortflow.graph.gradients.leading_sums import sums_as_matmul

            def rewrite(model):
                return sums_as_matmul(model, details=sums)
        engine = ForwardBackward((folder / "eval_model.onnx").read_bytes(), [n for n, _ in state.parameters],
                                 trainable, [], options(), providers, device="cuda:0" if cuda else "cpu",
                                 rewrite=rewrite)
        sums_rewritten = None if rewrite is None else len(sums.rewritten)
        if cuda:  # the engine's own device tensors, and gradient sums on the GPU
            params = {n: state._state.get_parameter(n).data for n, _ in state.parameters}
            buffers = [cupy.empty(state.parameters[n].data.shape, cupy.float32) for n in trainable]
            targets = [DeviceBuffer(b.data.ptr, b.size, n) for b, n in zip(buffers, trainable, strict=True)]
        else:
            params = {n: engine.ortvalue(state.parameters[n].data) for n, _ in state.parameters}
            buffers = [state.parameters[n].grad for n in trainable]

            def view(grad):
                return grad.numpy()
        seed = np.ones((), np.float32)

        def device_update() -> None:  # as KeptActivations on a CUDA rank
            for k, batch in enumerate(batches):
                arrays = {n: np.ascontiguousarray(batch[n]) for n in engine.feed_names if n not in params}
                feeds = [params[n] if n in params else engine.ortvalue(arrays[n]) for n in engine.feed_names]
                stream.after_host_copies()
                _, held = engine.forward(feeds, host=False)
                stream.synchronize()  # a stage reads (sends) the forward's outputs here
                grads = engine.backward(held, [seed])
                stream.sum_into(targets, grads, k == 0)
                stream.synchronize()  # and the input gradients here

        def host_update() -> None:
            for k, batch in enumerate(batches):
                arrays = {n: np.ascontiguousarray(batch[n]) for n in engine.feed_names if n not in params}
                _, held = engine.forward([params[n] if n in params else engine.ortvalue(arrays[n])
                                          for n in engine.feed_names])
                grads = engine.backward(held, [seed])
                for buffer, grad in zip(buffers, grads, strict=True):
                    flat = view(grad).reshape(buffer.shape)
                    if k == 0:
                        buffer[...] = flat
                    else:
                        buffer += flat

        update = device_update if cuda else host_update

        def gradients() -> list[np.ndarray]:
            return [cupy.asnumpy(b) if cuda else np.array(b) for b in buffers]
    if cuda:
        before = _gpu_used()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        before = _rss_kb("VmRSS")
    update()  # warm-up
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        update()
        times.append(time.perf_counter() - started)
    grown = _gpu_used() - before if cuda else 1024 * (_rss_kb("VmHWM") - before)
    np.savez(grads_out, *gradients())
    print(json.dumps({"update_s": statistics.median(times), "times": times, "rss_growth": grown,
                      "sums_rewritten": sums_rewritten}), flush=True)


def _run(run_dir: Path, method: str, reps: int, micro: int, grads: Path, stage_options: bool, device: str,
         deterministic: bool = True) -> dict:
    cmd = [sys.executable, "-m", "bench.engine_calls", "--worker", str(run_dir), "--method", method,
           "--reps", str(reps), "--micro", str(micro), "--grads", str(grads), "--device", device]
    cmd += ["--stage-options"] if stage_options else []
    cmd += [] if deterministic else ["--nondeterministic"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench engine-calls", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--grads", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5, help="timed updates per contender")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (contenders alternate)")
    parser.add_argument("--stage-options", action="store_true",
                        help="sessions made as a pipeline stage makes them (one shared arena, no memory patterns)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both contenders run")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="both contenders' sessions without the engine's deterministic compute")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.method, args.reps, args.micro, args.grads, args.stage_options, args.device,
               not args.nondeterministic)
        return 0
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-engine-calls-") as tmp:
        root = Path(tmp)
        for model in ("gpt2", "bench_gpt") + (("gpt_1024",) if args.device == "cuda" else ()):
            run_dir = _configure(root, model, args.micro, args.device, not args.nondeterministic)
            runs = {m: [] for m in METHODS}
            for r in range(args.rounds):
                for method in (METHODS if r % 2 == 0 else tuple(reversed(METHODS))):
                    runs[method].append(_run(run_dir, method, args.reps, args.micro, root / f"{model}-{method}.npz",
                                             args.stage_options, args.device, not args.nondeterministic))
            grads = {m: np.load(root / f"{model}-{m}.npz") for m in METHODS}
            a, b = grads["training_call"], grads["forward_backward"]
            equal = all(a[k].tobytes() == b[k].tobytes() for k in a.files)
            scale = max(float(np.abs(a[k]).max()) for k in a.files)
            worst = max(float(np.abs(a[k] - b[k]).max()) for k in a.files) / scale
            rows[model] = {m: {"update_s": statistics.median(x["update_s"] for x in runs[m]),
                               "rss_growth": max(x["rss_growth"] for x in runs[m])} for m in METHODS}
            rows[model].update(bitwise_equal=equal, max_relative_difference=worst, tensors=len(a.files),
                               gradient_graph_sums_as_matmul=runs["forward_backward"][0]["sums_rewritten"])
    record = {"micro_batches": args.micro, "reps": args.reps, "rounds": args.rounds, "models": rows,
              "stage_options": args.stage_options, "device": args.device,
              "deterministic_compute": not args.nondeterministic}
    where, memory = ("GPU 0", "GPU memory growth") if args.device == "cuda" else ("CPU, 1 thread", "RSS growth")
    lines = [f"# Training call against separate forward and backward calls ({where})", "",
             f"Medians over {args.rounds} interleaved rounds of {args.reps} updates of {args.micro} micro-batches; "
             f"session options {'of a pipeline stage' if args.stage_options else 'of an unsplit replica'}, "
             f"deterministic compute {'off' if args.nondeterministic else 'on'}. Where configure rewrites the "
             "training graph's leading-axis sums as MatMuls (`device: cuda` with deterministic compute), the "
             "forward+backward contender's gradient graph has them rewritten too, as a CUDA rank's kept stage or "
             "piece has (the count below).", "",
             f"| model | training call s/update | forward+backward s/update | ratio | {memory} training call MiB | "
             f"{memory} forward+backward MiB | gradients | gradient graph's sums as MatMuls |",
             "|---|---|---|---|---|---|---|---|"]
    for model, row in rows.items():
        t, f = row["training_call"], row["forward_backward"]
        same = "bitwise equal" if row["bitwise_equal"] else f"max rel diff {row['max_relative_difference']:.2g}"
        rewritten = row["gradient_graph_sums_as_matmul"]
        lines.append(f"| {model} | {t['update_s']:.4f} | {f['update_s']:.4f} | {f['update_s'] / t['update_s']:.2f} | "
                     f"{t['rss_growth'] / 2**20:.1f} | {f['rss_growth'] / 2**20:.1f} | {same} ({row['tensors']}) | "
                     f"{'-' if rewritten is None else rewritten} |")
    stem = (f"engine-calls-{socket.gethostname()}{'-cuda' if args.device == 'cuda' else ''}"
            f"{'-stage-options' if args.stage_options else ''}{'-nondeterministic' if args.nondeterministic else ''}")
    write_result(ROOT / "bench" / "out" / stem, record, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
