"""Where a pipeline rank's memory goes, component by component: pp 1 (unsplit) vs each stage of pp 2, in one run.

Run: ``.venv/bin/python -m bench.pipeline_breakdown [--layers 4 8] [--batch 4 32] [--micro 8]`` (writes
bench/results/pipeline-breakdown-<host>.md and .json). For each GPT (the bench GPT: vocab 256, T 64, d 128; 4 layers,
and 8 layers) it configures pp 1 and pp 2 (cuts chosen by configure, as a user gets them) and measures every rank kind
in a fresh process (no MPI) that builds what the trainer builds, in the trainer's order, with the trainer's options:
checkpoint state (parameters), the engine Module (training + eval sessions; gradient buffers), ortflow's AdamW, then
``m`` micro-batches of the rank's engine calls (stage 0: eval forward + training call; last stage and unsplit: the
training call), the update, then an eval pass.

Two measures at every phase, side by side:

* **heap**: bytes in use in the process's malloc heap (``bench/malloc_peak.c``, LD_PRELOADed: every malloc / free of
  the engine, numpy and Python counted by ``malloc_usable_size``) and their peak: the engine's buffers and what its
  arena holds, not pages. With the arena off (``--allocator none`` cells) the engine mallocs each tensor, so the
  calls' heap peak is their live working set (activations + kernel workspace).
* **RSS**: VmRSS / VmHWM (peak, reset before each phase with /proc/self/clear_refs).

The issue's definition (parameters + optimizer state + activations) is read from the engine's buffers (parameter and
gradient nbytes, AdamW moment nbytes) and the calls' live heap peak (arena off); the process baseline (Python + numpy +
onnxruntime + ortflow imported, before any model) is shown but not counted. "Stored for backward" is what the
training graph's backward nodes read from its forward (inferred shapes at the micro-batch size): the activations
proper; the live peak minus it is the backward's transient workspace. "Arena held": heap the trainer's allocator
keeps after the calls (its real footprint). "Sessions fixed": the engine sessions' heap less the gradient buffers.

Then, for each model, the trainer's own pieces under mpiexec (bench_pipeline's worker: runtime, 1F1B step, exchange,
update; RSS of the whole rank), pp 2 run twice: as now, and with every sent tensor held until the step's end (as
before ``MPIComm.release_sent``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1 / 2**20


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return 1024 * int(line.split()[1])
    return 0


class _Meter:
    """Heap (from the preloaded counter) and RSS, with peaks reset at each mark."""

    def __init__(self):
        self.lib = ctypes.CDLL(None)
        for name in ("mp_current", "mp_peak"):
            getattr(self.lib, name).restype = ctypes.c_longlong
        self.phases: dict[str, dict] = {}
        self.reset()

    def reset(self) -> None:
        self.lib.mp_reset_peak()
        Path("/proc/self/clear_refs").write_text("5")

    def mark(self, name: str) -> None:
        self.phases[name] = {"heap": self.lib.mp_current(), "heap_peak": self.lib.mp_peak(), "rss": _rss("VmRSS"),
                             "rss_peak": _rss("VmHWM"), "rss_anon": _rss("RssAnon"), "rss_file": _rss("RssFile")}
        self.reset()


def probe(run_dir: Path, stage: int | None, allocator: str, batch: int, micro: int) -> dict:
    """One rank kind in this process (under the LD_PRELOADed counter): phases, and the engine's buffer sizes."""
    meter = _Meter()
    import numpy as np
    import onnx

    from ortflow.build.records import GRAD_IN_SUFFIX, read_stages_record, stage_dir
    from ortflow.config import load_run_config
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.engine import api
    from ortflow.trainer import optim
    from ortflow.trainer.parallel.pipeline_stage import stage_session_options
    from ortflow.trainer.runtime import session_options

    meter.mark("baseline")
    cfg = load_run_config(run_dir)
    folder = cfg.artifacts_dir if stage is None else stage_dir(cfg.artifacts_dir, stage)
    record = read_stages_record(cfg.artifacts_dir) if stage is not None else None
    info = record["stages"][stage] if record else None
    last = info is None or stage == len(record["stages"]) - 1
    loader = TrainLoader(cfg.data_dir, batch, 0, 1, prefetch=0)
    batches = [dict(loader.batch(0, i)) for i in range(micro)]
    graph = onnx.load(str(folder / "training_model.onnx"), load_external_data=False).graph
    rng = np.random.default_rng(0)
    for i in graph.input:  # received tensors and arriving gradients: random, of the declared shape
        if info is None or i.name in batches[0] or not (i.name in info["receives"] or i.name.endswith(GRAD_IN_SUFFIX)):
            continue
        dims = [d.dim_value or batch for d in i.type.tensor_type.shape.dim]
        for b in batches:
            b[i.name] = rng.standard_normal(dims).astype(np.float32)
    del graph
    if allocator == "trainer":
        options = session_options(1) if stage is None else stage_session_options(1, "cpu")
    else:  # "none": no arena, so each tensor is its own malloc and the heap peak is the live working set
        options = session_options(1)
        options.enable_cpu_mem_arena = False
    meter.mark("feeds")
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    meter.mark("parameters")
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"), device="cpu",
                        session_options=options)
    meter.mark("sessions")
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    params = [state.parameters[n].data.reshape(-1) for n in trainable]
    update = optim.build_update(cfg.optimizer, optim.whole_segments(trainable, [p.size for p in params]), params)
    meter.mark("optimizer")
    names = None
    for i, feeds in enumerate(batches):
        if not last:  # a middle stage's forward (eval model), then the recompute + backward
            module.eval()
            out = module(*(feeds[n] for n in module.input_names()))
            del out
        module.train()
        names = names or module.input_names()
        out = module(*(feeds[n] for n in names))
        del out
        if i == 0:
            meter.mark("first micro-batch")
    grads = [state.parameters[n].grad for n in trainable]
    meter.mark("micro-batches")
    update.step([g.reshape(-1) for g in grads], 1e-3)
    module.lazy_reset_grad()
    meter.mark("update")
    module.eval()  # an eval pass: the eval loss (last stage, unsplit) or the forward to the next stage
    out = module(*(batches[0][n] for n in module.input_names()))
    del out
    meter.mark("eval")
    buffers = {
        "parameters": sum(state.parameters[n].data.nbytes for n, _ in state.parameters),
        "gradients": sum(g.nbytes for g in grads),
        "optimizer_state": sum(v.nbytes for v in update.state.values()),
        "optimizer_scratch": sum(s.nbytes for s in update.scratch) + sum(
            s.nbytes for t in update._thread_scratch for s in t),
        "received": sum(batches[0][n].nbytes for n in (info["receives"] if info else ())),
        "sent": sum(batches[0][n + GRAD_IN_SUFFIX].nbytes for n in (info["sends"] if info and not last else ())),
        "shared_parameters": sum(state.parameters[n].data.nbytes for n in (info.get("shared", {}) if info else ())),
    }
    buffers["stored_for_backward"] = stored_for_backward(folder / "training_model.onnx", batch)
    return {"phases": meter.phases, "buffers": buffers}


def stored_for_backward(path: Path, batch: int) -> int:
    """Bytes of the forward tensors that the training graph's backward nodes read (what a training call must keep
    from its forward pass to its backward pass), from the graph's inferred shapes at ``batch`` sequences. Backward
    nodes are the gradient builder's (``*Grad`` ops, ``*_Grad/*`` names, ``*_grad`` outputs, the accumulators)."""
    import numpy as np
    import onnx

    model = onnx.load(str(path))
    for i in model.graph.input:
        for d in i.type.tensor_type.shape.dim:
            if not d.dim_value and d.dim_param:
                d.dim_value = batch
    inferred = onnx.shape_inference.infer_shapes(model).graph
    size = {}
    for vi in [*inferred.value_info, *inferred.input, *inferred.output]:
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if dims and all(dims):
            size[vi.name] = int(np.prod(dims)) * 4

    def backward(node) -> bool:
        return ("Grad" in node.op_type or "_Grad" in node.name or node.op_type == "InPlaceAccumulatorV2"
                or any("_grad" in o or "_Grad" in o for o in node.output))

    forward = {o for n in model.graph.node if not backward(n) for o in n.output}
    stored = {x for n in model.graph.node if backward(n) for x in n.input if x in forward}
    return sum(size.get(x, 0) for x in stored)


def session_probe(run_dir: Path, stage: int, with_eval: bool) -> dict:
    """Heap and RSS that the engine Module adds for stage ``stage``, with or without its eval model."""
    meter = _Meter()
    from ortflow.build.records import stage_dir
    from ortflow.config import load_run_config
    from ortflow.engine import api
    from ortflow.trainer.parallel.pipeline_stage import stage_session_options

    folder = stage_dir(load_run_config(run_dir).artifacts_dir, stage)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    meter.mark("parameters")
    module = api.Module(str(folder / "training_model.onnx"), state,
                        str(folder / "eval_model.onnx") if with_eval else None, device="cpu",
                        session_options=stage_session_options(1, "cpu"))
    meter.mark("sessions")
    del module
    return meter.phases


def eval_session_rows(lib: Path, layers: int, batch: int) -> list[str]:
    """What the eval session costs a stage: the Module's heap and RSS with and without it (fresh process each)."""
    rows = [f"## The eval session's fixed cost (GPT {layers} layers, pp 2)", "",
            "`python -m bench.pipeline_breakdown --eval-session` (one fresh process per cell; MiB the engine Module "
            "adds above the loaded checkpoint state: graphs, kernels, gradient buffers)", "",
            "| stage | heap with eval model | heap without | difference | RSS with | RSS without | difference |",
            "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="pipeline-breakdown-") as tmp:
        run = _configure(Path(tmp), layers, 2, batch, 1)
        for stage in (0, 1):
            got = {}
            for with_eval in (True, False):
                cmd = [sys.executable, "-m", "bench.pipeline_breakdown", "--probe", str(run), "--stage", str(stage),
                       "--eval-session", "1" if with_eval else "0"]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "LD_PRELOAD": str(lib)})
                phases = json.loads(out.stdout.strip().splitlines()[-1])
                got[with_eval] = [MB * (phases["sessions"][k] - phases["parameters"][k]) for k in ("heap", "rss")]
            (h1, r1), (h0, r0) = got[True], got[False]
            rows.append(f"| {stage} | {h1:.2f} | {h0:.2f} | {h1 - h0:.2f} | {r1:.2f} | {r0:.2f} | {r1 - r0:.2f} |")
    return rows


def _library() -> Path:
    out = Path(tempfile.gettempdir()) / f"ortflow-malloc-peak-{os.getuid()}.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(ROOT / "bench" / "malloc_peak.c")],
                   check=True)
    return out


def _measure(lib: Path, run_dir: Path, stage: int | None, allocator: str, batch: int, micro: int) -> dict:
    cmd = [sys.executable, "-m", "bench.pipeline_breakdown", "--probe", str(run_dir), "--allocator", allocator,
           "--batch", str(batch), "--micro", str(micro)] + ([] if stage is None else ["--stage", str(stage)])
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "LD_PRELOAD": str(lib)})
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _launch(run_dir: Path, ranks: int, hold_sends: bool) -> list[dict]:
    """The trainer's pieces under mpiexec (bench_pipeline's worker): 1 warm-up + 2 steps of m micro-batches."""
    import shutil

    beside = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "bench.bench_pipeline", "--worker", str(run_dir),
           "--warmup", "1", "--steps", "2"] + (["--hold-sends"] if hold_sends else [])
    out = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if out.returncode:
        raise RuntimeError(out.stdout[-3000:])
    return [json.loads((run_dir / f"bench-rank{rank}.json").read_text()) for rank in range(ranks)]


def _configure(root: Path, layers: int, stages: int, batch: int, micro: int) -> Path:
    from bench.bench_pipeline import SHAPE
    from ortflow.build.configure import configure
    from ortflow.config import config_from_dict
    from ortflow.dataprep import prepare_data
    from ortflow.examples.gpt import build_gpt

    model = root / f"gpt{layers}.onnx"
    if not model.exists():
        build_gpt(model, **{**SHAPE, "num_layers": layers})
    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ortflow").rglob("*.py"))))
    name = f"gpt{layers}-pp{stages}-b{batch}"
    cfg = config_from_dict({
        "name": name, "output_dir": str(root / name), "model": {"path": str(model)},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": SHAPE["seq_len"]}},
        "train": {"batch_size": batch, "num_train_steps": micro, "gradient_accumulation_steps": micro},
        "optimizer": {"learning_rate": 1e-3},
        "distributed": {"num_ranks": stages, "pipeline_parallel_size": stages, "threads_per_rank": 1},
    })
    configure(cfg)
    prepare_data(cfg)
    return cfg.output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--allocator", default="trainer", choices=("trainer", "none"), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="GPT blocks (one model per value)")
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 32], help="sequences per micro-batch")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per rank (gradient_accumulation_steps)")
    parser.add_argument("--eval-session", nargs="?", const="table", default=None,
                        help="instead: what the eval session adds to a stage (appended to the results .md)")
    args = parser.parse_args(argv)
    if args.probe and args.eval_session is not None:
        print(json.dumps(session_probe(args.probe, args.stage, args.eval_session == "1")))
        return
    if args.eval_session is not None:
        rows = eval_session_rows(_library(), args.layers[0], args.batch[-1])
        out = ROOT / "bench" / "results" / f"pipeline-breakdown-{socket.gethostname()}.md"
        out.write_text(out.read_text() + "\n" + "\n".join(rows) + "\n")
        print("\n".join(rows))
        return
    if args.probe:
        print(json.dumps(probe(args.probe, args.stage, args.allocator, args.batch[0], args.micro)))
        return
    lib = _library()
    results = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-breakdown-") as tmp:
        for layers in args.layers:
            for b in args.batch:
                runs = {pp: _configure(Path(tmp), layers, pp, b, args.micro) for pp in (1, 2)}
                for rank, (pp, stage) in (("pp1", (1, None)), ("pp2 stage 0", (2, 0)), ("pp2 stage 1", (2, 1))):
                    for allocator in ("trainer", "none"):
                        got = _measure(lib, runs[pp], stage, allocator, b, args.micro)
                        results[f"{layers}|{b}|{rank}|{allocator}"] = got
                        print(layers, b, rank, allocator, "done", flush=True)
                for name, pp, hold in (("pp1", 1, False), ("pp2", 2, False), ("pp2 hold", 2, True)):
                    results[f"{layers}|{b}|mpi {name}"] = _launch(runs[pp], pp, hold)
                    print(layers, b, "mpiexec", name, "done", flush=True)
    command = "python -m bench.pipeline_breakdown " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "load_average": os.getloadavg(),
              "micro": args.micro, "layers": args.layers, "batch": args.batch, "raw": results}
    out = ROOT / "bench" / "results" / f"pipeline-breakdown-{socket.gethostname()}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    text = report(record)
    out.with_suffix(".md").write_text(text)
    print(text)


def components(trainer: dict, none: dict) -> dict:
    """MiB per component of one rank kind from its two cells (the trainer's allocator, and no arena)."""
    t, n, buf = trainer["phases"], none["phases"], trainer["buffers"]
    live = max(n["first micro-batch"]["heap_peak"], n["micro-batches"]["heap_peak"]) - n["optimizer"]["heap"]
    c = {
        "parameters": buf["parameters"], "gradients": buf["gradients"], "optimizer": buf["optimizer_state"],
        "activations": live, "stored": buf["stored_for_backward"],
        "arena_held": t["micro-batches"]["heap"] - t["optimizer"]["heap"],
        "eval_extra": max(0, t["eval"]["heap_peak"] - t["update"]["heap"]),
        "sessions_fixed": t["sessions"]["heap"] - t["parameters"]["heap"] - buf["gradients"],
        "boundary": buf["received"] + buf["sent"], "shared": buf["shared_parameters"],
        "scratch": buf["optimizer_scratch"],
        "rss_baseline": t["baseline"]["rss"],
        "rss_load": t["sessions"]["rss"] - t["feeds"]["rss"],
        "rss_libraries": (t["update"]["rss_file"] - t["sessions"]["rss_file"]),
        "rss_calls": max(t["first micro-batch"]["rss_peak"], t["micro-batches"]["rss_peak"]) - t["optimizer"]["rss"],
        "rss_peak": max(p["rss_peak"] for p in t.values()) - t["baseline"]["rss"],
        "anon_end": t["eval"]["rss_anon"] - t["baseline"]["rss_anon"],
    }
    c["issue_total"] = c["parameters"] + c["gradients"] + c["optimizer"] + c["activations"]
    return {k: v * MB for k, v in c.items()}


def _mpi_rows(mpi: dict) -> list[str]:
    rows = ["| rank | RSS peak | / pp1 | growth over the steps | sent buffers held: before -> after release_sent | "
            "received held | RSS peak with sends held as before |", "|---|---|---|---|---|---|---|"]
    base = mpi["pp1"][0]["memory"]
    rows.append(f"| pp1 | {base['rss_peak'] * MB:.1f} | 1.00 | {base['activations_peak'] * MB:.1f} | - | - | - |")
    for stage in (0, 1):
        m, old = mpi["pp2"][stage]["memory"], mpi["pp2 hold"][stage]["memory"]
        rows.append(f"| pp2 stage {stage} | {m['rss_peak'] * MB:.1f} | {m['rss_peak'] / base['rss_peak']:.2f} | "
                    f"{m['activations_peak'] * MB:.1f} | {old['sent_held'] * MB:.2f} -> {m['sent_held'] * MB:.2f} | "
                    f"{m['held_inputs'] * MB:.2f} | {old['rss_peak'] * MB:.1f} |")
    return rows


def report(record: dict) -> str:
    raw = record["raw"]
    lines = [f"# Pipeline rank memory, component by component, on {record['host']}", "",
             f"`{record['command']}`", "", __doc__.split("\n\n", 1)[1].strip(), "",
             f"{record['micro']} micro-batches per rank; 1 thread; 1-minute load average at the end "
             f"{record['load_average'][0]:.1f} (memory does not depend on it). MiB.", ""]
    for layers in record["layers"]:
        for b in record["batch"]:
            rows = {r: components(raw[f"{layers}|{b}|{r}|trainer"], raw[f"{layers}|{b}|{r}|none"])
                    for r in ("pp1", "pp2 stage 0", "pp2 stage 1")}
            base = rows["pp1"]
            lines += [f"## GPT {layers} layers, {b} sequences per micro-batch", "",
                      "| rank | params | grads | AdamW m+v | activations (live peak) | of which stored for backward | "
                      "**issue total** | / pp1 | "
                      "arena held | eval pass extra | sessions fixed | boundary tensors | RSS baseline (not counted) | "
                      "RSS libraries (Numba) | RSS peak above baseline | / pp1 | RssAnon above baseline | / pp1 |",
                      "|---|" + "---|" * 17]
            for rank, c in rows.items():
                cells = [f"{c['parameters']:.2f}", f"{c['gradients']:.2f}", f"{c['optimizer']:.2f}",
                         f"{c['activations']:.1f}", f"{c['stored']:.1f}", f"**{c['issue_total']:.1f}**",
                         f"{c['issue_total'] / base['issue_total']:.2f}", f"{c['arena_held']:.1f}",
                         f"{c['eval_extra']:.1f}", f"{c['sessions_fixed']:.1f}", f"{c['boundary']:.2f}",
                         f"{c['rss_baseline']:.0f}", f"{c['rss_libraries']:.0f}", f"{c['rss_peak']:.1f}",
                         f"{c['rss_peak'] / base['rss_peak']:.2f}", f"{c['anon_end']:.1f}",
                         f"{c['anon_end'] / base['anon_end']:.2f}"]
                lines.append(f"| {rank} | " + " | ".join(cells) + " |")
            lines += ["", f"Under mpiexec (the trainer's pieces: runtime, 1F1B step, exchange, update), "
                      f"{record['micro']} micro-batches, 1 warm-up + 2 steps; RSS of the whole rank:", "",
                      *_mpi_rows({k: raw[f"{layers}|{b}|mpi {k}"] for k in ("pp1", "pp2", "pp2 hold")})]
            lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
