"""Pipeline and tensor parallelism on a real export: pp 2 and hp 2 against dp 2 on the Hugging Face GPT-2 fixture.

Run: ``.venv/bin/python -m bench exports [--rounds 3] [--updates 12] [--micro 8] [--layouts pp2 pp2-recompute]``
(writes ``bench/out/exports-<host>-<date>.json`` and ``.md``). The driver configures a run per layout (default
dp2, pp2, hp2; pp2-recompute: pipeline stages that recompute their forward, distributed.recompute_forward) of the
committed GPT-2
export (``tests/fixtures/exports/gpt2.onnx``, unmodified) on the same text and the same global batch per update
(dp 2: 2 ranks x ``batch/2`` windows; pp 2 and hp 2: ``batch`` windows through the 2 ranks), then starts the real
trainer (``mpiexec -n 2 python -m ortflow.trainer``) for each, alternating the layouts round by round so that a busy
shared machine slows them alike; each round starts from the initial weights.

Step time: ``global batch / samples_per_s`` of each display window rank 0 logs, the first window (warm-up) left out,
median over windows and rounds. Memory per rank: the values of parameters and optimizer state each rank holds, read
from the final checkpoint's HDF5 datasets (dp: every rank holds everything; pp: its stage's file; hp: its slice
file), the largest rank reported; and the peak resident memory each rank logs at its end (the process's high-water
mark: runtime, parameters, optimizer state, activations and engine workspace), the largest rank's, median over
rounds. ``pp2`` against ``pp2-recompute`` is the activation-recomputation trade: kept activations (at most P - s
micro-batches per stage, 1F1B) against a second forward per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import host, provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "out"
LAYOUTS = {"dp2": {"num_ranks": 2}, "pp2": {"num_ranks": 2, "pipeline_parallel_size": 2},
           "pp2-recompute": {"num_ranks": 2, "pipeline_parallel_size": 2, "recompute_forward": True},
           "hp2": {"num_ranks": 2, "horizontal_parallel_size": 2}}
SEQ = 32
#: The line every rank logs at its end (trainer/parallel/layout_model.py).
_PEAK = re.compile(r"rank \d+ peak resident memory ([0-9.]+) MiB")


def _configure(work: Path, name: str, dist: dict, batch: int, micro: int, updates: int, cuts: tuple[str, ...] = ()):
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    corpus = work / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ortflow").rglob("*.py"))[:40]))
    per_rank = batch // 2 if name == "dp2" else batch  # the same global batch in every layout
    cfg = config_from_dict({
        "name": name, "output_dir": str(work / name),
        "model": {"path": str(ROOT / "tests" / "fixtures" / "exports" / "gpt2.onnx"),
                  "pipeline_cuts": list(cuts) if dist.get("pipeline_parallel_size", 1) > 1 else []},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": SEQ}, "eval_fraction": 0.02},
        "train": {"batch_size": per_rank, "gradient_accumulation_steps": micro, "num_train_steps": updates * micro,
                  "display_loss_steps": 2, "evaluation_period": 0},
        "optimizer": {"learning_rate": 1e-3},
        "checkpoint": {"period": 0, "max_num_checkpoints": 1},
        "distributed": dist,
    })
    configure(cfg)
    prepare_data(cfg)
    return cfg


def _run(cfg, mpiexec: str) -> tuple[float, str]:
    for leftover in ("checkpoints", "tensorboard", "progress.json", "timing.json"):
        path = cfg.output_dir / leftover
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.perf_counter()
    out = subprocess.run([mpiexec, "-n", str(cfg.distributed.num_ranks), sys.executable, "-m", "ortflow.trainer",
                          str(cfg.output_dir)], env=env, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{cfg.name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return time.perf_counter() - started, out.stdout + out.stderr


def _step_seconds(output: str, global_batch: int) -> list[float]:
    rates = [float(x) for x in re.findall(r"samples_per_s ([0-9.e+-]+)", output)]
    return [global_batch / r for r in rates[1:] if r > 0]  # the first window is the warm-up


def _memory_per_rank(cfg) -> dict:
    """Bytes of parameter and optimizer-state values held by the largest rank (from the final checkpoint)."""
    import h5py

    from ortflow.checkpoints import list_complete

    folder = list_complete(cfg.checkpoints_dir)[-1].path

    def values(path: Path, groups: tuple[str, ...] | None) -> int:
        total = 0
        with h5py.File(path, "r") as f:
            def add(name, obj):
                nonlocal total
                if isinstance(obj, h5py.Dataset) and (groups is None or name.split("/")[0] in groups):
                    total += obj.size * obj.dtype.itemsize
            f.visititems(add)
        return total

    ranks: dict[str, dict[str, int]] = {}
    for path in sorted(folder.glob("params*.h5")):
        key = path.name.removeprefix("params")
        ranks.setdefault(key, {})["parameters"] = values(path, ("parameters",))
    for path in sorted(folder.glob("optimizer*.h5")):
        key = path.name.removeprefix("optimizer")
        ranks.setdefault(key, {})["optimizer_state"] = values(path, None)
    largest = max(ranks.values(), key=lambda r: r.get("parameters", 0) + r.get("optimizer_state", 0))
    return {"files": ranks, "largest_rank": largest}


def markdown(result: dict, others: list[str], args) -> str:
    """The report: the provenance block, then one row per layout against dp 2."""
    lines = [f"# {', '.join(others)} vs dp 2 on the GPT-2 export ({result['date']})", "",
             *provenance(result["command"], result["host"]), "",
             f"Global batch {result['global_batch_windows']} windows of {SEQ} tokens per update in {args.micro} "
             f"micro-batches, {args.updates} updates per run, {args.rounds} interleaved rounds.", "",
             "| layout | median step (s) | step vs dp 2 | parameters per rank (bytes) | optimizer state per rank "
             "(bytes) | state vs dp 2 | peak resident memory per rank (MiB) |", "|---|---|---|---|---|---|---|"]
    for name, row in result["layouts"].items():
        lines.append(f"| {name} | {row['median_step_s']:.4f} | {row['step_vs_dp2']:.2f} | {row.get('parameters', 0)} "
                     f"| {row.get('optimizer_state', 0)} | {row['state_vs_dp2']:.2f} "
                     f"| {row['peak_resident_mib']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_exports", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three layouts")
    parser.add_argument("--updates", type=int, default=12, help="weight updates per run")
    parser.add_argument("--batch", type=int, default=8, help="windows of 32 tokens per micro-batch (global)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["dp2", "pp2", "hp2"],
                        help="layouts to run (dp2 is the reference and always runs)")
    parser.add_argument("--cut", nargs="*", default=[], help="model.pipeline_cuts of the pipeline layouts "
                        "(default: chosen automatically)")
    parser.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    command = "python -m bench.bench_exports " + " ".join(sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="bench-exports-"))
    try:
        layouts = ["dp2", *(name for name in args.layouts if name != "dp2")]
        cfgs = {name: _configure(work, name, LAYOUTS[name], args.batch, args.micro, args.updates, tuple(args.cut))
                for name in layouts}
        steps: dict[str, list[float]] = {name: [] for name in layouts}
        walls: dict[str, list[float]] = {name: [] for name in layouts}
        memory, peaks = {}, {}
        for r in range(args.rounds):
            for name in (layouts if r % 2 == 0 else list(reversed(layouts))):
                wall, output = _run(cfgs[name], args.mpiexec)
                steps[name] += _step_seconds(output, args.batch * args.micro)
                peaks.setdefault(name, []).append(max(float(m) for m in _PEAK.findall(output)))
                walls[name].append(wall)
                memory[name] = _memory_per_rank(cfgs[name])
                print(f"round {r} {name}: wall {wall:.1f} s, step {statistics.median(steps[name]):.4f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": host(),
        "model": "tests/fixtures/exports/gpt2.onnx (HF GPT-2: 4 layers, d 64, 4 heads, vocab 512, tied)",
        "global_batch_windows": args.batch * args.micro, "micro_batches": args.micro, "seq_len": SEQ,
        "updates": args.updates,
        "rounds": args.rounds,
        "layouts": {name: {"median_step_s": statistics.median(steps[name]), "windows": len(steps[name]),
                           "wall_s": walls[name], **memory[name]["largest_rank"],
                           "peak_resident_mib": statistics.median(peaks[name]),
                           "files": memory[name]["files"]} for name in layouts},
    }
    base = result["layouts"]["dp2"]
    for row in result["layouts"].values():
        row["step_vs_dp2"] = row["median_step_s"] / base["median_step_s"]
        held = row.get("parameters", 0) + row.get("optimizer_state", 0)
        row["state_vs_dp2"] = held / (base.get("parameters", 0) + base.get("optimizer_state", 0))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"exports-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result, [n for n in layouts if n != "dp2"], args)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
