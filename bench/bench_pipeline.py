"""Pipeline parallelism on CPU ranks: per-rank memory (pp 2 vs pp 1) and throughput vs data-parallel on the same ranks.

Run: ``python -m bench pipeline [--steps 6] [--rounds 3]`` (writes bench/out/pipeline-<host>.json
and .md). The driver configures three runs of one GPT (pp1: 1 rank; dp2: 2 ranks data-parallel; pp2: 2 ranks, 2
stages) and starts each under mpiexec with this module's worker, which runs the trainer's own pieces (init_runtime,
pipeline_step / the engine calls, the communicator, the update) for warm-up + timed steps and writes one JSON file per
rank. Rounds alternate the contenders, so a busy shared machine slows them alike.

Memory per rank: parameters, gradient buffers and AdamW moments are counted from the rank's engine state (4 bytes per
value: parameter + gradient + 2 moments); activations are the peak resident memory over all steps above the resident
memory of the started session before the first step (VmHWM after resetting it with /proc/self/clear_refs; the
engine's allocator keeps freed blocks, so only the first steps show the growth), and, for a stage, the received inputs
it holds between forward and backward.

Bubble: on each stage, idle = 1 - (seconds inside engine calls) / (step seconds), against the textbook
(P-1)/(m+P-1) for P stages and m micro-batches with equal stage times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
SHAPE = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "num_layers": 4, "num_heads": 4}
BATCH = 4


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _state_bytes(state, trainable: list[str]) -> dict:
    values = sum(int(np.prod(state.parameters[n].data.shape)) for n in trainable)
    return {"parameters": 4 * values, "gradients": 4 * values, "optimizer_state": 8 * values, "values": values}


def _kept_parts(rt) -> int:
    """How many of the rank's engine parts run the forward once and keep its activations (0: recomputing)."""
    return sum(getattr(part, "kept", None) is not None for part in getattr(rt.body, "pieces", [rt.body]))


def _messages(rt) -> str | None:
    """How the rank's pipeline messages travel: ``nccl`` (device to device), ``host`` (host arrays over the process
    group), None unsplit."""
    if rt.stage is None:
        return None
    return "nccl" if rt.stage.device_pipe is not None else "host"


def worker(run_dir: Path, warmup: int, steps: int, hold_sends: bool = False) -> None:
    """Under mpiexec: warm-up + timed steps of the run's layout with the trainer's own pieces; one JSON per rank.

    ``hold_sends``: keep every sent tensor until the step's end, as before ``MPIComm.release_sent`` (for comparison).
    """
    if hold_sends:
        from ortflow.trainer.comm.mpi import MPIComm

        MPIComm.release_sent = lambda self: None
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.trainer.parallel.schedule import pipeline_step
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, comm = start_mpi(run_dir)
    rt = init_runtime(run_dir, cfg, comm)
    k = cfg.train.gradient_accumulation_steps
    shard, shards = rt.data_shard()
    batches = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=0).iter_from(0)
    pipelined = cfg.distributed.pipeline_parallel_size > 1
    grads = rt.gradient_buffers() if pipelined else []
    times, compute, held, sent = [], [], 0, 0
    # The engine's allocator keeps freed blocks, so the peak is taken from before the first step: what the steps add
    # above the started session (parameters, gradients and moments are already allocated) is activations + workspace.
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    rss_before = _rss_kb("VmRSS")
    for step in range(warmup + steps):
        comm.barrier("bench step")
        started = time.perf_counter()
        if pipelined:
            stats = pipeline_step(rt.stage, batches, k)
            mine = rt.exchange.reduce(grads, k * rt.data.num_replicas, np.zeros(0, np.float32))
            comm.allreduce_sum(np.zeros(3), "pipeline loss, stop, norm")
            rt.update.step(mine, cfg.optimizer.learning_rate)
            rt.after_update()  # the engine's sums and a stage's kept activations start again
            busy, held, sent = stats.compute_s, max(held, stats.held_bytes), max(sent, stats.sent_bytes)
        else:
            names = rt.module.input_names()
            for _ in range(k):
                feeds = next(batches)
                rt.module(*(feeds[n] for n in names))
            busy = time.perf_counter() - started
            grads = grads or rt.gradient_buffers()
            mine = rt.exchange.reduce(grads, k * comm.size, np.zeros(2, np.float32))
            rt.update.step(mine, cfg.optimizer.learning_rate)
            rt.module.lazy_reset_grad()
        if step >= warmup:
            times.append(time.perf_counter() - started)
            compute.append(busy)
    device_used = None
    if rt.device != "cpu":  # this rank's GPU as a whole (the engine's CUDA arena, NCCL buffers, the CUDA context)
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        device_used = total - free
    record = {
        "rank": comm.rank, "stage": rt.stage.stage if rt.stage is not None else 0,
        "step_s": statistics.median(times), "device": rt.device,
        "device_memory_used": device_used,
        "compute_s": statistics.median(compute), "kept_parts": _kept_parts(rt),
        "messages": _messages(rt),
        "samples_per_step": k * cfg.train.batch_size * (comm.size // cfg.distributed.pipeline_parallel_size),
        "memory": {**_state_bytes(rt.state, rt.trainable), "held_inputs": held, "sent_held": sent,
                   "activations_peak": 1024 * (_rss_kb("VmHWM") - rss_before), "rss_peak": 1024 * _rss_kb("VmHWM")},
    }
    (run_dir / f"bench-rank{comm.rank}.json").write_text(json.dumps(record))  # ranks' stdout lines interleave
    comm.barrier("bench done")
    comm.close()


def memory_worker(run_dir: Path, stage: int | None, calls: int, micro_batch: int) -> None:
    """One process, no MPI: the engine memory of one rank's calls on one micro-batch (unsplit, or stage ``stage``).

    Unsplit: the training call. Stage 0: the eval-model forward, then the training call (recompute + backward) driven
    by a gradient of the sent tensor's shape. Last stage: the training call on a received tensor of its shape. Peak
    RSS above the started session's RSS = activations + engine workspace (no MPI buffers in this process).
    """
    import onnx

    from ortflow.artifacts_folder import GRAD_IN_SUFFIX, read_stages_record, stage_dir
    from ortflow.config import load_run_config
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.engine import api
    from ortflow.trainer.comm.engine_buffers import HostBuffers
    from ortflow.trainer.parallel.pipeline_stage import stage_session_options
    from ortflow.trainer.runtime import session_options

    cfg = load_run_config(run_dir)
    folder = cfg.artifacts_dir if stage is None else stage_dir(cfg.artifacts_dir, stage)
    started = _rss_kb("VmRSS")
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    options = session_options(1) if stage is None else stage_session_options(1, HostBuffers())  # as the trainer
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cpu",
                        session_options=options)
    batch = TrainLoader(cfg.data_dir, micro_batch, 0, 1, prefetch=0).batch(0, 0)
    info = read_stages_record(cfg.artifacts_dir)["stages"][stage] if stage is not None else None
    feeds = dict(batch)
    graph = onnx.load(str(folder / "training_model.onnx"), load_external_data=False).graph
    for i in graph.input:  # received tensors and arriving gradients: random, of the declared shape (batch filled in)
        if i.name in feeds or (info is None) or not (i.name in info["receives"] or i.name.endswith(GRAD_IN_SUFFIX)):
            continue
        dims = [d.dim_value or micro_batch for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss_kb("VmRSS")
    last = info is None or info["index"] == len(read_stages_record(cfg.artifacts_dir)["stages"]) - 1
    for _ in range(calls):
        if not last:  # a middle stage's forward pass runs the eval model first
            module.eval()
            module(*(feeds[n] for n in module.input_names()))
        module.train()
        module(*(feeds[n] for n in module.input_names()))
    print(json.dumps({"activations_peak": 1024 * (_rss_kb("VmHWM") - before), "sessions": 1024 * (before - started)}),
          flush=True)


def _memory(run_dir: Path, stage: int | None, micro_batch: int) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_pipeline", "--memory", str(run_dir), "--calls", "3",
           "--memory-batch", str(micro_batch)]
    cmd += [] if stage is None else ["--stage", str(stage)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _inputs(root: Path) -> tuple[Path, Path]:
    """The GPT of ``SHAPE`` and the text corpus every run folder under ``root`` trains on (made once)."""
    from ortflow.examples.gpt import build_gpt

    model, corpus = root / "gpt.onnx", root / "corpus.txt"
    if not model.exists():
        build_gpt(model, **SHAPE)
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ortflow").rglob("*.py"))))
    return model, corpus


def _configure_as(shape: dict, *args, **kwargs) -> Path:
    """:func:`_configure` in a spawned process, the parent's ``SHAPE`` passed along."""
    SHAPE.update(shape)
    return _configure(*args, **kwargs)


def _configure(root: Path, name: str, ranks: int, stages: int, micro: int, batch: int = BATCH,
               device: str = "cpu", recompute: bool = False, like: Path | None = None, cuts: tuple = (),
               deterministic: bool = True) -> Path:
    """Configure and prepare the data of one contender's run folder ``root/name``; ``like``: a run folder with the
    same artifacts (same stage count), whose artifacts and shards it reuses (hard links) instead of building them;
    ``cuts``: ``model.pipeline_cuts`` (default: the automatic cuts); ``deterministic``:
    ``distributed.deterministic_compute`` on GPUs."""
    from bench.common import link_configured
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    model, corpus = _inputs(root)
    gpu = {"device": "cuda", "use_nccl": True, "collective_timeout_s": 60.0,
           "deterministic_compute": deterministic} if device == "cuda" else {}
    cfg = config_from_dict({
        "name": name, "output_dir": str(root / name), "model": {"path": str(model), "pipeline_cuts": list(cuts)},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": SHAPE["seq_len"]}},
        "train": {"batch_size": batch, "num_train_steps": micro, "gradient_accumulation_steps": micro},
        "optimizer": {"learning_rate": 1e-3},
        "distributed": {"num_ranks": ranks, "pipeline_parallel_size": stages, "threads_per_rank": 1,
                        "recompute_forward": recompute, **gpu},
    })
    linked = like is not None and link_configured(cfg, like)
    built, data = configure(cfg), prepare_data(cfg)
    if linked and not (built.reused and data.reused):
        raise RuntimeError(f"{cfg.output_dir}: configure did not reuse the artifacts and shards linked from {like}")
    return cfg.output_dir


def _launch(run_dir: Path, ranks: int, warmup: int, steps: int) -> list[dict]:
    beside = Path(sys.executable).parent / "mpiexec"  # the venv's launcher, else the machine's (device scripts)
    mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m",
           "bench.bench_pipeline", "--worker", str(run_dir), "--warmup", str(warmup), "--steps", str(steps)]
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:])
    return [json.loads((run_dir / f"bench-rank{rank}.json").read_text()) for rank in range(ranks)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--memory", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hold-sends", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true",
                        help="pp 2 stages recompute their forward in the backward call (distributed.recompute_forward)")
    parser.add_argument("--calls", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--memory-batch", type=int, nargs="+", default=[4, 32],
                        help="micro-batch sizes (sequences) of the memory measurement")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 8], help="micro-batches per update (m)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.warmup, args.steps, args.hold_sends)
    if args.memory:
        return memory_worker(args.memory, args.stage, args.calls, args.memory_batch[0])
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        root = Path(tmp)
        first = args.micro[0]
        runs = {("pp1", first): (_configure(root, f"pp1-m{first}", 1, 1, first), 1)}
        pp2 = _configure(root, f"pp2-m{first}", 2, 2, first, recompute=args.recompute)
        for m in args.micro:  # every unsplit run reuses pp1's artifacts, every pp 2 run the first one's
            runs[("dp2", m)] = (_configure(root, f"dp2-m{m}", 2, 1, m, like=runs[("pp1", first)][0]), 2)
            runs[("pp2", m)] = (_configure(root, f"pp2-m{m}", 2, 2, m, recompute=args.recompute, like=pp2), 2)
        results: dict = {f"{kind}-m{m}": [] for kind, m in runs}
        engine_memory = {b: {"pp1": _memory(runs[("pp1", first)][0], None, b),
                             "pp2": [_memory(runs[("pp2", first)][0], s, b) for s in (0, 1)]}
                         for b in args.memory_batch}
        load = [os.getloadavg()[0]]
        for _ in range(args.rounds):
            for (kind, m), (run_dir, ranks) in runs.items():
                results[f"{kind}-m{m}"].append(_launch(run_dir, ranks, args.warmup, args.steps))
            load.append(os.getloadavg()[0])
    summary = summarize(results, args.micro, engine_memory)
    command = "python -m bench pipeline " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "cores": os.cpu_count(),
              "platform": platform.platform(), "shape": SHAPE, "batch_size": BATCH, "summary": summary,
              "recompute_forward": args.recompute,
              "load_average_1min": load, "rounds": args.rounds, "timed_steps": args.steps,
              "raw": results}
    out = ROOT / "bench" / "out" / f"pipeline-{socket.gethostname()}"
    write_result(out, record, report(record))
    print(report(record))


def summarize(results: dict, micro: list[int], engine_memory: dict) -> dict:
    """Medians over rounds: memory per rank, samples/s, and each stage's idle fraction vs (P-1)/(m+P-1)."""
    def med(key: str, pick) -> float:
        return statistics.median(pick(r) for r in results[key])

    first = micro[0]
    ranks = {"pp1": results[f"pp1-m{first}"][0][0]["memory"]}
    ranks.update({f"pp2 stage {s}": results[f"pp2-m{first}"][0][s]["memory"] for s in (0, 1)})
    for key, index in (("pp1", 0), ("pp2 stage 0", 0), ("pp2 stage 1", 1)):
        run = f"pp1-m{first}" if key == "pp1" else f"pp2-m{first}"
        ranks[key]["rss_growth_mpi"] = med(run, lambda r, i=index: r[i]["memory"]["activations_peak"])
        engine = {b: (m["pp1"] if key == "pp1" else m["pp2"][index]) for b, m in engine_memory.items()}
        ranks[key]["activations_by_micro_batch"] = {b: e["activations_peak"] for b, e in engine.items()}
        ranks[key]["sessions_rss"] = next(iter(engine.values()))["sessions"]
    throughput = {}
    for m in micro:
        row = {}
        for kind in ("dp2", "pp2"):
            row[kind] = med(f"{kind}-m{m}", lambda r: r[0]["samples_per_step"] / max(x["step_s"] for x in r))
        row["pp2_over_dp2"] = row["pp2"] / row["dp2"]
        row["idle_stage"] = [med(f"pp2-m{m}", lambda r, s=s: 1 - r[s]["compute_s"] / r[s]["step_s"]) for s in (0, 1)]
        row["bubble_theory"] = 1 / (m + 1)
        throughput[m] = row
    return {"memory": ranks, "throughput": throughput}


def report(record: dict) -> str:
    """The markdown summary written next to the JSON."""
    s, mb = record["summary"], 1 / 2**20
    lines = [f"# Pipeline bench on {record['host']} ({record['cores']} cores)", "",
             f"GPT {record['shape']}, 1 thread per rank; training micro-batch {record['batch_size']} sequences; pp 2 "
             f"stages {'recompute their forward' if record.get('recompute_forward') else 'keep their activations'}.",
             "",
             "## Memory per rank (MiB)", "",
             "Static: parameters, gradient buffers, AdamW moments (from the engine state). Activations: peak RSS "
             "growth of one process (no MPI) running the rank's engine calls on one micro-batch of b sequences "
             "(unsplit: the training call; stage 0: eval forward + training call; stage 1: the training call), "
             "sessions made as the trainer makes them. Held: received tensors kept between forward and backward "
             f"(pipelined run, b = {record['batch_size']}). RSS under mpiexec: growth of the rank over the "
             "benchmark's steps (adds MPI transport buffers), for reference.", ""]
    sizes = sorted(next(iter(s["memory"].values()))["activations_by_micro_batch"], key=int)
    head = "| rank | params | AdamW moments | grads | held | " + " | ".join(
        f"activations b={b} | total b={b}" for b in sizes) + " | RSS under mpiexec |"
    lines += [head, "|" + "---|" * (6 + 2 * len(sizes))]
    totals = {}
    for name, m in s["memory"].items():
        static = m["parameters"] + m["gradients"] + m["optimizer_state"] + m["held_inputs"]
        cells = []
        for b in sizes:
            act = m["activations_by_micro_batch"][b]
            totals.setdefault(b, {})[name] = static + act
            cells.append(f"{act * mb:.1f} | {(static + act) * mb:.1f}")
        lines.append(f"| {name} | {m['parameters'] * mb:.2f} | {m['optimizer_state'] * mb:.2f} | "
                     f"{m['gradients'] * mb:.2f} | {m['held_inputs'] * mb:.3f} | " + " | ".join(cells)
                     + f" | {m['rss_growth_mpi'] * mb:.1f} |")
    lines.append("")
    for b in sizes:
        t = totals[b]
        lines.append(f"b={b}: stage 0 / unsplit {t['pp2 stage 0'] / t['pp1']:.2f}, stage 1 / unsplit "
                     f"{t['pp2 stage 1'] / t['pp1']:.2f}")
    lines.append("")
    lines.append("Engine sessions as built, before any call (RSS; holds the parameter and gradient buffers, graphs and "
                 "kernels; not in the totals): " + ", ".join(f"{name} {m['sessions_rss'] * mb:.1f}"
                                                            for name, m in s["memory"].items()) + " MiB.")
    load = record.get("load_average_1min")
    lines += ["", "## Throughput vs data-parallel on the same 2 ranks", "",
              f"Medians of {record.get('rounds')} rounds x {record.get('timed_steps')} timed steps, contenders "
              "alternating within each round; 1-minute load average before and after each round: "
              + (", ".join(f"{x:.1f}" for x in load) if load else "not recorded") + ".", "",
              "| m | dp2 samples/s | pp2 samples/s | pp2/dp2 | idle stage 0 | idle stage 1 | (P-1)/(m+P-1) |",
              "|---|---|---|---|---|---|---|"]
    for m, row in s["throughput"].items():
        lines.append(f"| {m} | {row['dp2']:.1f} | {row['pp2']:.1f} | {row['pp2_over_dp2']:.2f} | "
                     f"{row['idle_stage'][0]:.2f} | {row['idle_stage'][1]:.2f} | {row['bubble_theory']:.2f} |")
    return "\n".join(lines) + "\n"



GPU_DOC = """Pipeline parallelism on 2 GPUs: pp 2 keeping its activations vs pp 2 recomputing vs dp 2 (NCCL).

Run on a machine with 2 GPUs and the GPU engine (docs/gpu.md):
``python -m bench pipeline-gpu [--batch-size 16] [--rounds 3] [--steps 6] [--micro 2 8] [--d-model 128 ...]
[--budget-s S] [--cuts NAME] [--nondeterministic]`` (writes bench/out/pipeline-gpu-<host>.json and .md, or into --out).
The same GPT and the same worker as the CPU bench above (the trainer's own init_runtime, pipeline_step, NCCL exchange
and device update), configured with ``device: cuda, use_nccl: true``, in four contenders: pp1 (one GPU, its memory
only), dp2, pp2 (stage 0 runs each micro-batch's forward once and keeps its activations) and pp2-recompute
(``distributed.recompute_forward: true``: stage 0 recomputes its forward inside the training call). Rounds alternate the
contenders (reversed every other round); ``--budget-s`` starts no round after that many seconds (at least one runs). The
unsplit runs share one configure's artifacts, the pp 2 runs another's (hard links: recompute_forward, the rank count and
the micro-batch count are outside configure's fingerprint); the two configures that build run at once, each in a process
of its own. Memory here is each rank's whole GPU as used after the steps (cudaMemGetInfo: the engine's CUDA arena, NCCL
buffers and the CUDA context), for reference: the CPU bench measures the per-rank memory split.

Each rank reports how its pipeline messages went: ``nccl`` (device to device,
ortflow.trainer.comm.device_pipe.DevicePipe: what CUDA stages with NCCL use) or ``host`` (host arrays over the
process group); the report's last column.

Bubble: on each stage, idle = 1 - (seconds inside engine calls) / (update seconds), against (P-1)/(m+P-1).
Kept / recompute: per round, pp2's stage 0 engine ms and samples/s over pp2-recompute's, the median over rounds.
"""

#: The pp 2 contenders of the GPU bench: name -> distributed.recompute_forward.
GPU_PIPELINES = {"pp2": False, "pp2-recompute": True}


def _samples_per_s(ranks: list[dict]) -> float:
    return ranks[0]["samples_per_step"] / max(x["step_s"] for x in ranks)


def gpu_summarize(results: dict, micro: list[int]) -> dict:
    """Medians over rounds: samples/s of dp2 and each pp 2 contender, each stage's update/engine ms and idle share,
    the paired kept/recompute ratios, GPU memory."""
    def med(key: str, pick) -> float:
        return statistics.median(pick(r) for r in results[key])

    rows = {}
    for m in micro:
        dp2 = med(f"dp2-m{m}", _samples_per_s)
        row = {"dp2": {"samples_per_s": dp2}, "bubble_theory": 1 / (m + 1)}
        for kind in GPU_PIPELINES:
            key = f"{kind}-m{m}"
            row[kind] = {
                "samples_per_s": med(key, _samples_per_s), "over_dp2": med(key, _samples_per_s) / dp2,
                "stage_step_ms": [1e3 * med(key, lambda r, s=s: r[s]["step_s"]) for s in (0, 1)],
                "stage_engine_ms": [1e3 * med(key, lambda r, s=s: r[s]["compute_s"]) for s in (0, 1)],
                "idle_stage": [med(key, lambda r, s=s: 1 - r[s]["compute_s"] / r[s]["step_s"]) for s in (0, 1)],
                "kept_parts": [r.get("kept_parts") for r in results[key][0]],
                "messages": [r.get("messages") for r in results[key][0]],
            }
        kept, recomputing = results[f"pp2-m{m}"], results[f"pp2-recompute-m{m}"]
        pairs = list(zip(kept, recomputing, strict=True))  # the same round: ratios are paired, then the median taken
        row["kept_over_recompute"] = {
            "samples_per_s": statistics.median(_samples_per_s(a) / _samples_per_s(b) for a, b in pairs),
            "stage0_engine_ms": statistics.median(a[0]["compute_s"] / b[0]["compute_s"] for a, b in pairs),
            "rounds": len(pairs)}
        rows[m] = row
    first = micro[0]
    memory = {"pp1": results[f"pp1-m{first}"][0][0]["device_memory_used"],
              "dp2 rank 0": results[f"dp2-m{first}"][0][0]["device_memory_used"]}
    for kind in GPU_PIPELINES:
        memory.update({f"{kind} stage {s}": results[f"{kind}-m{first}"][0][s]["device_memory_used"] for s in (0, 1)})
    return {"throughput": rows, "device_memory_used": memory}


def gpu_report(record: dict) -> str:
    """The markdown summary written next to the JSON."""
    s = record["summary"]
    rounds = record.get("rounds_run", record["rounds"])
    lines = [f"# Pipeline bench on 2 GPUs ({record['host']})", "",
             f"GPT {record['shape']}, micro-batch {record['batch_size']} sequences, `device: cuda`, `use_nccl: true`; "
             f"medians of {rounds} rounds x {record['timed_steps']} timed updates. pp2: stage 0 keeps its "
             "activations; pp2-recompute: `recompute_forward: true`. Cut at "
             + (f"`model.pipeline_cuts: {record['cuts']}`." if record.get("cuts") else "the automatic cut.")
             + ("" if record.get("deterministic_compute", True) else
                " Every contender with `distributed.deterministic_compute: false`."), "",
             "| m | contender | samples/s | vs dp2 | stage 0 update ms | stage 1 update ms | stage 0 engine ms | "
             "stage 1 engine ms | idle stage 0 | idle stage 1 | (P-1)/(m+P-1) | parts keeping (stage 0, 1) | "
             "messages (stage 0, 1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, row in s["throughput"].items():
        lines.append(f"| {m} | dp2 | {row['dp2']['samples_per_s']:.1f} | 1.00 | | | | | | | | | |")
        for kind in GPU_PIPELINES:
            c = row[kind]
            kept = ", ".join("-" if k is None else str(k) for k in c["kept_parts"])
            how = ", ".join(str(x) for x in c.get("messages", []))
            lines.append(f"| {m} | {kind} | {c['samples_per_s']:.1f} | {c['over_dp2']:.2f} | "
                         f"{c['stage_step_ms'][0]:.2f} | {c['stage_step_ms'][1]:.2f} | {c['stage_engine_ms'][0]:.2f} | "
                         f"{c['stage_engine_ms'][1]:.2f} | {c['idle_stage'][0]:.2f} | {c['idle_stage'][1]:.2f} | "
                         f"{row['bubble_theory']:.2f} | {kept} | {how} |")
    lines += ["", "pp2 (keeping) / pp2-recompute, paired within each round, median over rounds:", ""]
    for m, row in s["throughput"].items():
        r = row["kept_over_recompute"]
        lines.append(f"- m = {m}: stage 0 engine ms {r['stage0_engine_ms']:.2f}x, samples/s {r['samples_per_s']:.2f}x "
                     f"({r['rounds']} rounds)")
    lines += ["", "GPU memory in use after the steps (MiB, whole device: engine arena + NCCL + CUDA context): "
              + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in s["device_memory_used"].items() if v is not None), ""]
    return "\n".join(lines)


def gpu_runs(root: Path, micro: list[int], batch: int, cuts: tuple = (), deterministic: bool = True) -> dict:
    """The GPU bench's contenders, configured: (kind, m) -> (run folder, ranks). One configure builds the unsplit
    artifacts (pp1, every dp2), one the pp 2 stages (every pp2 and pp2-recompute, cut at ``cuts`` when given), both
    at once in processes of their own; the others reuse them. ``deterministic``: every contender's
    ``distributed.deterministic_compute``."""
    first, det = micro[0], {"deterministic": deterministic}
    _inputs(root)
    unsplit, stages = in_processes([partial(_configure_as, dict(SHAPE), root, "pp1", 1, 1, first, batch, "cuda",
                                            **det),
                                    partial(_configure_as, dict(SHAPE), root, f"pp2-m{first}", 2, 2, first, batch,
                                            "cuda", GPU_PIPELINES["pp2"], cuts=cuts, **det)])
    runs = {("pp1", first): (unsplit, 1)}
    for m in micro:
        runs[("dp2", m)] = (_configure(root, f"dp2-m{m}", 2, 1, m, batch, "cuda", like=unsplit, **det), 2)
        for kind, recompute in GPU_PIPELINES.items():
            runs[(kind, m)] = (_configure(root, f"{kind}-m{m}", 2, 2, m, batch, "cuda", recompute, like=stages,
                                          cuts=cuts, **det), 2)
    return runs


def gpu_main(argv: list[str] | None = None, *, clock=time.perf_counter) -> None:
    """``python -m bench pipeline-gpu``; ``clock``: seconds, for the budget."""
    parser = argparse.ArgumentParser(description=GPU_DOC.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no round after this many seconds of launches (at least one round runs)")
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 8], help="micro-batches per update (m)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--cuts", nargs="+", default=[],
                        help="model.pipeline_cuts of the pp 2 contenders (default: the automatic cut; `ortflow "
                             "validate` lists the places)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="every contender with distributed.deterministic_compute false (the engine's faster, "
                             "not repeatable kernels)")
    add_shape_options(parser, SHAPE)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="folder for the .json/.md")
    args = parser.parse_args(argv)
    set_shape(SHAPE, args)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-gpu-") as tmp:
        started = clock()
        runs = gpu_runs(Path(tmp), args.micro, args.batch_size, tuple(args.cuts), not args.nondeterministic)
        print(f"configured {len(runs)} runs in {clock() - started:.1f} s", flush=True)
        results: dict = {f"{kind}-m{m}": [] for kind, m in runs}
        started, rounds_run = clock(), 0
        while rounds_run < args.rounds and (not rounds_run or args.budget_s is None
                                            or clock() - started < args.budget_s):
            order = list(runs.items())
            for (kind, m), (run_dir, ranks) in order if rounds_run % 2 == 0 else order[::-1]:
                if kind == "pp1" and rounds_run:  # one GPU unsplit: its memory only, once
                    continue
                results[f"{kind}-m{m}"].append(_launch(run_dir, ranks, args.warmup, args.steps))
                print(f"{kind} m={m}: " + ", ".join(f"rank {r['rank']} {r['step_s'] * 1e3:.2f} ms/update "
                                                   f"(engine {r['compute_s'] * 1e3:.2f} ms)"
                                                   for r in results[f"{kind}-m{m}"][-1]), flush=True)
            rounds_run += 1
    command = "python -m bench pipeline-gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "platform": platform.platform(),
              "shape": dict(SHAPE), "batch_size": args.batch_size, "cuts": args.cuts,
              "deterministic_compute": not args.nondeterministic, "rounds": args.rounds,
              "rounds_run": rounds_run, "timed_steps": args.steps, "load_average_1min": os.getloadavg()[0],
              "summary": gpu_summarize(results, args.micro), "raw": results}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"pipeline-gpu-{socket.gethostname()}"
    write_result(out, record, gpu_report(record))
    print(gpu_report(record))


if __name__ == "__main__":
    main()
