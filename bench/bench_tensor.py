"""Tensor parallelism: per-rank memory of the split layers (hp 2 vs hp 1) and step time, on CPU ranks or GPUs.

Run: ``python -m bench tensor [--steps 4] [--rounds 3]`` (writes bench/out/tensor-<host>.json and
.md); on GPUs ``--device cuda`` with a model where splitting pays, e.g. ``--device cuda --d-model 2048 --num-layers 4
--seq-len 256 --batch 16 --vocab-size 8192`` (``--nondeterministic``: every contender without the engine's
deterministic compute). The driver configures four runs of one GPT (hp1: 1 rank; dp2: 2 ranks
data-parallel; hp2: 2 ranks, tensor parallel, every piece but the last running its forward once and keeping its
activations; hp2-recompute: hp2 with ``distributed.recompute_forward: true``, the pieces recomputing their forward
inside the training call) and starts each under mpiexec with this module's worker, which runs the trainer's own pieces
(init_runtime, TensorParallel.micro_step / the engine's calls, the gradient exchange, ortflow's update) for warm-up +
timed steps and writes one JSON file per rank. Rounds alternate the contenders (reversed every other round), so a busy
shared machine slows them alike; ``--budget-s`` starts no round after that many seconds. dp2 reuses hp1's artifacts
and hp2-recompute hp2's (hard links: the rank count and recompute_forward are outside configure's fingerprint); hp1's
and hp2's configures run at once, each in a process of its own. hp 2 reads each batch on both ranks (samples/s counts
it once); dp 2 reads two.

Memory of the split layers on a rank (the weights that hp 2 slices, named by the hp 2 run's ``tensor.json``):
parameter values read from the rank's engine state (4 bytes each), gradient buffers (the same count), and the
optimizer state that ortflow's update allocated for them (AdamW's two moments, counted from its segments). Time:
median step seconds; for hp 2 also the seconds spent in the activation/input-gradient all-reduces (``tp_sum``) and
in the pieces' engine calls; hp2 / hp2-recompute ratios are paired within a round, the median over rounds. On GPUs
each hp rank also records CUDA events on its engine stream around every piece's forward, backward and sum
(:class:`GpuTimeline`): the GPU milliseconds of each per step, and the stream's idle time, in the log and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench.common import add_shape_options, in_processes, set_shape, write_result

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"vocab_size": 256, "seq_len": 64, "d_model": 256, "num_layers": 2, "num_heads": 8}
BATCH, MICRO = 4, 2
RUN = {"device": "cpu", "mpiexec": str(Path(sys.executable).parent / "mpiexec"), "batch": BATCH, "deterministic": True}
#: The tensor bench's contenders: name -> (ranks, tensor-parallel size, distributed.recompute_forward).
CONTENDERS = {"hp1": (1, 1, False), "dp2": (2, 1, False), "hp2": (2, 2, False), "hp2-recompute": (2, 2, True)}


def _split_names(artifacts_dir: Path) -> list[str]:
    return sorted(json.loads((artifacts_dir / "tensor" / "tensor.json").read_text())["slicing"])


def _memory(rt, names: list[str]) -> dict:
    def values(name: str) -> int:
        owner = rt.body.param(name) if rt.dims.tp > 1 else rt.state.parameters[name]
        return int(np.prod(owner.data.shape))

    split = sum(values(n) for n in names)
    total = sum(values(n) for n in rt.trainable)
    update = rt.update
    state = sum(sum(v.size for v in update.state_views(i)) for i, seg in enumerate(update.segments)
                if seg.name in names)
    return {"split_parameters": 4 * split, "split_gradients": 4 * split, "split_optimizer_state": 4 * state,
            "all_parameters": 4 * total, "optimizer_state_total": int(update.state_bytes)}


def _timed(call, seconds: list[float]):
    """``call``, adding the seconds each call takes to ``seconds[0]``."""
    def timed(*args):
        started = time.perf_counter()
        try:
            return call(*args)
        finally:
            seconds[0] += time.perf_counter() - started
    return timed


class GpuTimeline:
    """Where a CUDA hp rank's GPU time goes: a CUDA event on the rank's engine stream before and after each piece's
    separate forward, its backward and each tensor-parallel sum (the work the rank queues there runs in that order;
    a sum's event completes when the sum has), read once per step after the host waited for the stream. Recording
    an event costs the host microseconds and the GPU nothing, so the step runs as it does without the timeline.

    Per step: the GPU milliseconds of each kind of work (``fw``/``bw`` per piece, ``sum``), and ``span``: from the
    first recorded start to the last end. ``span`` less the work is the engine stream's idle time: the training
    calls of the loss's piece (on the module's own stream, host-timed as ``module``) and the gaps where the GPU
    waited for the host to queue work.
    """

    def __init__(self, stream):
        self.stream, self.marks = stream, []  # (kind, start event, end event)

    def wrap(self, call, kind: str):
        def timed(*args, **kwargs):
            start = self.stream.record()
            try:
                return call(*args, **kwargs)
            finally:
                self.marks.append((kind, start, self.stream.record()))
        return timed

    def take(self, elapsed_ms) -> dict[str, float]:
        """This step's milliseconds per kind (and ``span``); ``elapsed_ms(a, b)``: GPU time between two events that
        completed. Clears the marks."""
        self.stream.synchronize()
        ms = timeline_ms([(kind, elapsed_ms(self.marks[0][1], a), elapsed_ms(self.marks[0][1], b))
                          for kind, a, b in self.marks]) if self.marks else {}
        self.marks = []
        return ms


def timeline_ms(intervals: list[tuple[str, float, float]]) -> dict[str, float]:
    """Milliseconds per kind from (kind, start, end) intervals on one stream (ms from a common origin), ``span``
    from the first start to the last end, and ``work``: the sum of every interval."""
    out: dict[str, float] = {}
    for kind, start, end in intervals:
        out[kind] = out.get(kind, 0.0) + (end - start)
    out["work"] = sum(end - start for _, start, end in intervals)
    out["span"] = max(end for _, _, end in intervals) - min(start for _, start, _ in intervals)
    return out


def worker(run_dir: Path, names_from: Path, warmup: int, steps: int) -> None:
    """Under mpiexec: warm-up + timed steps with the trainer's own pieces; one JSON per rank."""
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, comm = start_mpi(run_dir)
    rt = init_runtime(run_dir, cfg, comm)
    k = cfg.train.gradient_accumulation_steps
    shard, shards = rt.data_shard()
    batches = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=0).iter_from(0)
    tensor, body = rt.dims.tp > 1, rt.body
    reduce_s, engine_s, module_s = [0.0], [0.0], [0.0]
    engine_stream = getattr(getattr(body, "tensors", None), "engine", None) if tensor else None
    timeline = GpuTimeline(engine_stream.stream) if engine_stream is not None else None
    if tensor:  # the seconds spent in the tensor-parallel sums and in the pieces' engine calls
        body.tp_sum = _timed(body.tp_sum, reduce_s)
        body.tensors.call = _timed(_timed(body.tensors.call, engine_s), module_s)
        if timeline is not None:
            body.tp_sum = timeline.wrap(body.tp_sum, "sum")
        for index, piece in enumerate(body.pieces):  # a piece keeping its activations: separate forward, backward
            if piece.kept is not None:
                piece.kept.forward = _timed(piece.kept.forward, engine_s)
                piece.kept.backward = _timed(piece.kept.backward, engine_s)
                if timeline is not None:
                    piece.kept.forward = timeline.wrap(piece.kept.forward, f"fw{index}")
                    piece.kept.backward = timeline.wrap(piece.kept.backward, f"bw{index}")
    grads = rt.gradient_buffers()
    times, reduces, engines, gpu = [], [], [], []
    for step in range(warmup + steps):
        comm.barrier("bench step")
        reduce_s[0] = engine_s[0] = module_s[0] = 0.0
        started = time.perf_counter()
        if tensor:
            for _ in range(k):
                body.micro_step(next(batches))
            if timeline is not None:  # the micro-steps' GPU time (the host waited for the stream at their end)
                ms = timeline.take(_elapsed_ms)
                if step >= warmup:
                    gpu.append({**ms, "module": module_s[0] * 1e3})
            body.sum_tied_gradients()  # as the trainer's reduce: replicated-parameter sums over tp, tied sums
            divisor = k * rt.data.num_replicas
        else:
            names = rt.module.input_names()
            for _ in range(k):
                feeds = next(batches)
                rt.module(*(feeds[n] for n in names))
            divisor = k * comm.size
        mine = rt.exchange.reduce(grads, divisor, np.zeros(0, np.float32))
        rt.update.step(mine, cfg.optimizer.learning_rate)
        rt.after_update()  # as the trainer: tied copies, the engines' gradient sums and kept pieces start again
        if step >= warmup:
            times.append(time.perf_counter() - started)
            reduces.append(reduce_s[0])
            engines.append(engine_s[0])
    kept = sum(getattr(p, "kept", None) is not None for p in rt.engine_parts()) if tensor else 0
    record = {"rank": comm.rank, "step_s": statistics.median(times), "allreduce_s": statistics.median(reduces),
              "engine_calls_s": statistics.median(engines), "kept_parts": kept,
              "gpu_ms": {key: statistics.median(g.get(key, 0.0) for g in gpu) for key in gpu[0]} if gpu else None,
              "samples_per_step": k * cfg.train.batch_size * (comm.size // cfg.distributed.horizontal_parallel_size),
              "memory": _memory(rt, _split_names(names_from))}
    (run_dir / f"bench-rank{comm.rank}.json").write_text(json.dumps(record))
    comm.barrier("bench done")
    comm.close()


def gpu_line(ms: dict[str, float] | None) -> str:
    """One rank's GPU timeline per step, in words (forwards and backwards summed over the pieces)."""
    if not ms:
        return ""
    fw = sum(v for key, v in ms.items() if key.startswith("fw"))
    bw = sum(v for key, v in ms.items() if key.startswith("bw"))
    idle = ms["span"] - ms["work"]
    return (f"GPU ms: forwards {fw:.1f}, backwards {bw:.1f}, sums {ms.get('sum', 0.0):.1f}, engine stream idle "
            f"{idle:.1f} of a {ms['span']:.1f} span (the loss piece's training calls: {ms.get('module', 0.0):.1f} "
            "on the host)")


def _elapsed_ms(start, end) -> float:
    import cupy

    return cupy.cuda.get_elapsed_time(start, end)


def _inputs(root: Path) -> tuple[Path, Path]:
    """The GPT of ``SHAPE`` and the text corpus every run folder under ``root`` trains on (made once)."""
    from ortflow.examples.gpt import build_gpt

    model, corpus = root / "gpt.onnx", root / "corpus.txt"
    if not model.exists():
        build_gpt(model, **SHAPE)
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ortflow").rglob("*.py"))))
    return model, corpus


def _configure_as(shape: dict, run: dict, *args, **kwargs) -> Path:
    """:func:`_configure` in a spawned process, the parent's ``SHAPE`` and ``RUN`` passed along."""
    SHAPE.update(shape)
    RUN.update(run)
    return _configure(*args, **kwargs)


def _configure(root: Path, name: str, ranks: int, hp: int, pp: int = 1, recompute: bool = False,
               like: Path | None = None) -> Path:
    """Configure and prepare the data of the run folder ``root/name``; ``like``: a run folder with the same artifacts
    (same layout), whose artifacts and shards it reuses (hard links) instead of building them."""
    from bench.common import link_configured
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    if (root / name / "configure.json").exists() and (root / name / "data").exists():
        return root / name  # configured by an earlier call with --root
    model, corpus = _inputs(root)
    cfg = config_from_dict({
        "name": name, "output_dir": str(root / name), "model": {"path": str(model)},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": SHAPE["seq_len"]}},
        "train": {"batch_size": RUN["batch"], "num_train_steps": MICRO, "gradient_accumulation_steps": MICRO},
        "optimizer": {"learning_rate": 1e-3},
        "distributed": {"num_ranks": ranks, "horizontal_parallel_size": hp, "pipeline_parallel_size": pp,
                        "threads_per_rank": 1, "device": RUN["device"], "use_nccl": RUN["device"] == "cuda",
                        "recompute_forward": recompute,
                        **({"deterministic_compute": RUN["deterministic"]} if RUN["device"] == "cuda" else {})},
    })
    linked = like is not None and link_configured(cfg, like)
    built, data = configure(cfg), prepare_data(cfg)
    if linked and not (built.reused and data.reused):
        raise RuntimeError(f"{cfg.output_dir}: configure did not reuse the artifacts and shards linked from {like}")
    return cfg.output_dir


def configure_contenders(root: Path, names=tuple(CONTENDERS)) -> dict[str, tuple[Path, int]]:
    """The run folders of the contenders ``names`` (hp1 and hp2 always) under ``root`` (configured there, or reused
    from an earlier call): name -> (run folder, ranks). Two configures build artifacts, at once in processes of their
    own: hp1's (dp2 reuses them) and hp2's (hp2-recompute reuses them)."""
    _inputs(root)
    builders = {name: (ranks, hp) for name, (ranks, hp, _) in CONTENDERS.items() if name in ("hp1", "hp2")}
    built = in_processes([partial(_configure_as, dict(SHAPE), dict(RUN), root, name, ranks, hp)
                          for name, (ranks, hp) in builders.items()])
    runs = {name: (run_dir, builders[name][0]) for name, run_dir in zip(builders, built, strict=True)}
    for name, (ranks, hp, recompute) in CONTENDERS.items():
        if name not in runs and name in names:
            like = next(runs[other][0] for other, (_, h) in builders.items() if h == hp)
            runs[name] = (_configure(root, name, ranks, hp, recompute=recompute, like=like), ranks)
    return {name: runs[name] for name in CONTENDERS if name in runs}


def _launch(run_dir: Path, names_from: Path, ranks: int, warmup: int, steps: int,
            bench_name: str = "tensor") -> list[dict]:
    """``python -m bench BENCH_NAME --worker RUN_DIR`` under mpiexec; each rank's JSON record."""
    cmd = [RUN["mpiexec"], "-n", str(ranks), sys.executable, "-m", "bench", bench_name, "--worker",
           str(run_dir), "--names-from", str(names_from), "--warmup", str(warmup),
           "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:])
    return [json.loads((run_dir / f"bench-rank{rank}.json").read_text()) for rank in range(ranks)]


def summarize(results: dict) -> dict:
    """Medians over rounds: split-layer memory per rank (and its ratio to hp 1), step time, samples/s; hp2 against
    hp2-recompute (when it ran), paired within each round."""
    def med(key: str, pick) -> float:
        return statistics.median(pick(r) for r in results[key])

    memory = {"hp1": results["hp1"][0][0]["memory"], "hp2 rank 0": results["hp2"][0][0]["memory"],
              "hp2 rank 1": results["hp2"][0][1]["memory"]}
    base = memory["hp1"]
    ratios = {key: {f: m[f] / base[f] for f in ("split_parameters", "split_optimizer_state", "all_parameters")}
              for key, m in memory.items() if key != "hp1"}
    timing = {}
    for kind in (k for k in CONTENDERS if k in results):
        step = med(kind, lambda r: max(x["step_s"] for x in r))
        timing[kind] = {"step_s": step, "samples_per_s": results[kind][0][0]["samples_per_step"] / step,
                        "allreduce_s": med(kind, lambda r: max(x["allreduce_s"] for x in r)),
                        "engine_calls_s": med(kind, lambda r: max(x.get("engine_calls_s", 0.0) for x in r)),
                        "kept_parts": [x.get("kept_parts") for x in results[kind][0]]}
    summary = {"memory": memory, "memory_ratio_vs_hp1": ratios, "timing": timing,
               "hp2_step_vs_hp1": timing["hp2"]["step_s"] / timing["hp1"]["step_s"]}
    if "hp2-recompute" in results:
        pairs = list(zip(results["hp2"], results["hp2-recompute"], strict=True))  # round by round

        def ratio(field: str) -> float:
            return statistics.median(max(x[field] for x in a) / max(x[field] for x in b) for a, b in pairs)

        summary["hp2_kept_vs_recompute"] = {"step_s": ratio("step_s"), "engine_calls_s": ratio("engine_calls_s"),
                                            "rounds": len(pairs)}
    return summary


def report(record: dict) -> str:
    s = record["summary"]
    mib = 2**20
    where = "GPUs" if record.get("device") == "cuda" else "CPU ranks"
    lines = [f"# Tensor parallelism on {where} ({record['host']}, {record['cores']} cores)", "",
             f"GPT {record['shape']}, batch {record['batch_size']} x "
             f"{record.get('micro', MICRO)} micro-batches per update, 1 thread per rank, AdamW (ortflow's update)."
             + ("" if record.get("deterministic_compute", True) else
                " Every contender with `distributed.deterministic_compute: false`."),
             f"GPUs: {record.get('gpus') or '-'}", "",
             "| rank | split-layer params MiB | their AdamW state MiB | all params MiB | split params vs hp1 | "
             "all params vs hp1 |", "|---|---|---|---|---|---|"]
    for key, m in s["memory"].items():
        ratio = s["memory_ratio_vs_hp1"].get(key, {"split_parameters": 1.0, "all_parameters": 1.0})
        lines.append(f"| {key} | {m['split_parameters'] / mib:.2f} | {m['split_optimizer_state'] / mib:.2f} | "
                     f"{m['all_parameters'] / mib:.2f} | {ratio['split_parameters']:.3f} | "
                     f"{ratio['all_parameters']:.3f} |")
    lines += ["", "| layout | step s (median) | samples/s | all-reduce s per step | hp engine calls s per step | "
              "pieces keeping activations (per rank) |", "|---|---|---|---|---|---|"]
    for kind, t in s["timing"].items():
        kept = ", ".join("-" if k is None else str(k) for k in t.get("kept_parts", []))
        lines.append(f"| {kind} | {t['step_s']:.3f} | {t['samples_per_s']:.1f} | {t['allreduce_s']:.3f} | "
                     f"{t.get('engine_calls_s', 0.0):.3f} | {kept or '-'} |")
    lines += ["", f"hp2 step time / hp1: {s['hp2_step_vs_hp1']:.2f}"]
    if "hp2_kept_vs_recompute" in s:
        r = s["hp2_kept_vs_recompute"]
        lines.append(f"hp2 (keeping) / hp2-recompute, paired within each of {r['rounds']} rounds, median: step time "
                     f"{r['step_s']:.2f}x, engine calls {r['engine_calls_s']:.2f}x")
    timelines = [(kind, r) for kind in ("hp2", "hp2-recompute") for r in record.get("raw", {}).get(kind, [[]])[-1]
                 if r.get("gpu_ms")]
    if timelines:
        lines += ["", "GPU timeline of the last round (CUDA events on each rank's engine stream, per step):"]
        lines += [f"- {kind} rank {r['rank']}: {gpu_line(r['gpu_ms'])}" for kind, r in timelines]
    lines += ["", f"Split by hp 2 (tensor.json): {record.get('split_names', '(not recorded)')}"]
    return "\n".join(lines) + "\n"


def _gpus() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                         check=False)  # fmt: skip
    names = out.stdout.split("\n")
    return f"{len([n for n in names if n.strip()])} x {names[0].strip()}" if out.returncode == 0 else "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--names-from", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no round after this many seconds of launches (at least one round runs)")
    add_shape_options(parser, SHAPE)
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per micro-batch")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--mpiexec", default=RUN["mpiexec"], help="the MPI launcher")
    parser.add_argument("--root", type=Path, help="configure the four runs here and keep them (default: a temporary "
                        "folder); runs already configured there are reused")
    parser.add_argument("--tag", default="", help="suffix of the result files (tensor-<host>[-tag].json/.md)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="with --device cuda: every contender with distributed.deterministic_compute false (the "
                        "engine's faster kernels, no bitwise resume)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="which contenders run, comma-separated (hp1 and hp2 always run; e.g. hp1,hp2 leaves out "
                        "dp2 and hp2-recompute)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.names_from, args.warmup, args.steps)
    names = {"hp1", "hp2", *(n.strip() for n in args.contenders.split(",") if n.strip())}
    if names - set(CONTENDERS):
        parser.error(f"--contenders: unknown {sorted(names - set(CONTENDERS))}; choose from {', '.join(CONTENDERS)}")
    if args.nondeterministic and args.device != "cuda":
        parser.error("--nondeterministic applies to --device cuda (CPU ranks keep deterministic_compute)")
    RUN.update(device=args.device, mpiexec=args.mpiexec, batch=args.batch, deterministic=not args.nondeterministic)
    set_shape(SHAPE, args)
    with tempfile.TemporaryDirectory(prefix="bench-tensor-") as tmp:
        root = args.root or Path(tmp)
        runs = configure_contenders(root, names)
        hp2 = runs["hp2"][0]
        split_names = _split_names(hp2 / "artifacts")
        results: dict = {kind: [] for kind in runs}
        started, rounds_run = time.perf_counter(), 0
        while rounds_run < args.rounds and (not rounds_run or args.budget_s is None
                                            or time.perf_counter() - started < args.budget_s):
            order = list(runs.items())
            for kind, (run_dir, ranks) in order if rounds_run % 2 == 0 else order[::-1]:
                results[kind].append(_launch(run_dir, hp2 / "artifacts", ranks, args.warmup, args.steps))
                print(f"{kind}: " + ", ".join(f"rank {r['rank']} {r['step_s'] * 1e3:.1f} ms/step (sums "
                                              f"{r['allreduce_s'] * 1e3:.1f}, engine calls "
                                              f"{r['engine_calls_s'] * 1e3:.1f})" for r in results[kind][-1]),
                      flush=True)
                for r in results[kind][-1]:
                    if r.get("gpu_ms"):
                        print(f"  rank {r['rank']} {gpu_line(r['gpu_ms'])}", flush=True)
            rounds_run += 1
    command = "python -m bench tensor " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "cores": os.cpu_count(),
              "platform": platform.platform(), "shape": SHAPE, "batch_size": RUN["batch"], "micro": MICRO,
              "device": args.device, "gpus": _gpus() if args.device == "cuda" else None, "rounds": args.rounds,
              "deterministic_compute": RUN["deterministic"],
              "rounds_run": rounds_run, "summary": summarize(results),
              "split_names": split_names, "raw": results}
    out = ROOT / "bench" / "out" / f"tensor-{socket.gethostname()}{'-' + args.tag if args.tag else ''}"
    write_result(out, record, report(record))
    print(report(record))



PIPE_TENSOR_DOC = """Pipeline x tensor parallelism on CPU ranks: step time and per-rank memory of pp 2 x hp 2
(parameters + optimizer state) against pp 2 and hp 2 (and the unsplit model) on the same GPT.

Run: ``python -m bench pipe-tensor [--steps 4] [--rounds 3]`` (writes
bench/out/pipe-tensor-<host>.json and .md). The driver configures the four runs with
:func:`_configure` (the model of the tensor bench: GPT d_model 256, 8 heads, 2 layers, seq 64; batch
4 x 2 micro-batches; 1 thread per rank; AdamW) and starts each under mpiexec with its worker
(``python -m bench pipe-tensor --worker``), which runs the trainer's own pieces (``init_runtime``; the rank model's
``accumulate``, which runs the pipeline's 1F1B over a stage's graph or its tensor-parallel pieces; the gradient
exchange; ortflow's update) for warm-up + timed steps and writes one JSON per rank. Rounds alternate the
layouts, so a busy shared machine slows them alike.

Memory per rank: trainable parameter values held by the rank (4 bytes each, its slices for split weights), their
gradient buffers (the same), and the optimizer state ortflow's update allocated (``Update.state_bytes``).
"""

#: name -> (ranks, hp, pp)
PIPE_TENSOR_LAYOUTS = {"pp1hp1": (1, 1, 1), "pp2": (2, 1, 2), "hp2": (2, 2, 1), "pp2xhp2": (4, 2, 2)}


def pipe_tensor_worker(run_dir: Path, warmup: int, steps: int) -> None:
    """Under mpiexec: warm-up + timed updates with the trainer's own pieces; one JSON per rank."""
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, comm = start_mpi(run_dir)
    rt = init_runtime(run_dir, cfg, comm)
    k = cfg.train.gradient_accumulation_steps
    shard, shards = rt.data_shard()
    batches = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=0).iter_from(0)
    grads = rt.gradient_buffers()
    times = []
    for step in range(warmup + steps):
        comm.barrier("bench step")
        started = time.perf_counter()
        rt.accumulate(batches, k)  # through the stages' 1F1B on a pipeline
        mine = rt.exchange.reduce(grads, k * shards, np.zeros(0, np.float32))
        rt.update.step(mine, cfg.optimizer.learning_rate)
        rt.body.after_update()  # the engines' gradient sums start again
        if step >= warmup:
            times.append(time.perf_counter() - started)
    param = rt.body.param if rt.dims.tp > 1 else (lambda n: rt.state.parameters[n])
    values = sum(int(np.prod(param(n).data.shape)) for n in rt.trainable)
    record = {"rank": comm.rank, "step_s": statistics.median(times), "samples_per_step": k * cfg.train.batch_size *
              shards, "memory": {"parameters": 4 * values, "gradients": 4 * values,
                                 "optimizer_state": int(rt.update.state_bytes)}}
    (run_dir / f"bench-rank{comm.rank}.json").write_text(json.dumps(record))
    comm.barrier("bench done")
    comm.close()


def pipe_tensor_summarize(results: dict) -> dict:
    """Per layout: median (over rounds) of the slowest rank's step, samples/s, and each rank's memory."""
    out = {}
    base = results["pp1hp1"][0][0]["memory"]
    base_static = base["parameters"] + base["optimizer_state"]
    for name, rounds in results.items():
        step = statistics.median(max(r["step_s"] for r in ranks) for ranks in rounds)
        memory = [r["memory"] for r in rounds[0]]
        static = [m["parameters"] + m["optimizer_state"] for m in memory]
        out[name] = {"ranks": len(rounds[0]), "step_s": step,
                     "samples_per_s": rounds[0][0]["samples_per_step"] / step, "memory": memory,
                     "largest_rank_params_plus_optimizer": max(static),
                     "largest_rank_vs_unsplit": max(static) / base_static}
    return out


def pipe_tensor_report(record: dict) -> str:
    s, mib = record["summary"], 2**20
    lines = [f"# Pipeline x tensor parallelism on CPU ranks ({record['host']}, {record['cores']} cores)", "",
             f"GPT {record['shape']}, batch {BATCH} x {MICRO} micro-batches per update, 1 thread per rank, AdamW "
             "(ortflow's update); medians over rounds of the slowest rank's step.", "",
             "| layout | ranks | step s | samples/s | per-rank params MiB | per-rank AdamW state MiB | "
             "largest rank params+state vs unsplit |", "|---|---|---|---|---|---|---|"]
    for name, t in s.items():
        params = " / ".join(f"{m['parameters'] / mib:.2f}" for m in t["memory"])
        state = " / ".join(f"{m['optimizer_state'] / mib:.2f}" for m in t["memory"])
        lines.append(f"| {name} | {t['ranks']} | {t['step_s']:.3f} | {t['samples_per_s']:.1f} | {params} | {state} | "
                     f"{t['largest_rank_vs_unsplit']:.3f} |")
    return "\n".join(lines) + "\n"


def pipe_tensor_main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=PIPE_TENSOR_DOC.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--names-from", type=Path, help=argparse.SUPPRESS)  # bench_tensor's launcher passes it
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.worker:
        return pipe_tensor_worker(args.worker, args.warmup, args.steps)
    with tempfile.TemporaryDirectory(prefix="bench-pipe-tensor-") as tmp:
        root = Path(tmp)
        runs = {name: (_configure(root, name, ranks, hp, pp), ranks)
                for name, (ranks, hp, pp) in PIPE_TENSOR_LAYOUTS.items()}
        results: dict = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, (run_dir, ranks) in runs.items():
                results[name].append(_launch(run_dir, run_dir, ranks, args.warmup, args.steps,
                                             bench_name="pipe-tensor"))
    command = "python -m bench pipe-tensor " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "cores": os.cpu_count(),
              "platform": platform.platform(), "load_avg": os.getloadavg(), "shape": SHAPE, "batch_size": BATCH,
              "summary": pipe_tensor_summarize(results), "raw": results}
    out = ROOT / "bench" / "out" / f"pipe-tensor-{socket.gethostname()}"
    write_result(out, record, pipe_tensor_report(record))
    print(pipe_tensor_report(record))


if __name__ == "__main__":
    main()
