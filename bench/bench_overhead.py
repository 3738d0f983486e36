"""Trainer overhead at 1 x 1 from per-phase counters: the trainer's own breakdown against the bare loop's.

A wall-clock comparison of two processes on a shared 2-core machine swings by +-5% from round to round (other
processes take the core), far above a 1% goal. Counters inside each process are not affected that way: what the
trainer adds is time outside the engine's calls, which its breakdown (``timing.json``, ortflow.trainer.timing) measures
directly. So, in interleaved rounds (bare, trainer, then reversed), on the same GPT, artifacts, batches and 1 thread:

* bare loop: per update ``fb`` = ``module(*inputs)`` and ``upd`` = ``optimizer.step(); module.lazy_reset_grad()``
  (``optimizer.step()``: ortflow's update on the engine's buffers, the one the trainer applies);
* trainer (``mpiexec -n 1 python -m ortflow.trainer``): per update, each phase of its display windows after warm-up.

Reported, each as min / median / max over rounds:

* ``added``: trainer time outside the engine's calls (data wait, exchange, norm, other: everything but its
  forward+backward and update phases) / bare update time: what the trainer adds. Measured in one process, so the
  machine's noise scales it but does not swamp it (the goal);
* ``engine``: the trainer's engine calls (forward+backward + optimizer step) / bare update time - 1 (paired per
  round): whether the trainer slows the engine itself (threads, memory); cross-process, as noisy as the machine;
* ``wall``: trainer update time / bare update time - 1 (paired per round), the coarse figure earlier reports used.

Run: ``python -m bench overhead --rounds 9 --out bench/out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import write_result

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
MPIEXEC = str(Path(PYTHON).parent / "mpiexec")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

BARE = """
import json, sys, time
import numpy as np
from bench.workers import engine_loop
from ortflow.dataprep.loader import TrainLoader

steps, warmup = int(sys.argv[2]), int(sys.argv[3])
cfg, state, module, optimizer = engine_loop(sys.argv[1], 1)  # optimizer.step(): ortflow's update, as the trainer's
loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
batches = [loader.batch(0, k) for k in range(steps)]
names, fb, upd = module.input_names(), [], []
for feeds in batches:
    t0 = time.perf_counter()
    float(module(*(feeds[n] for n in names)))
    t1 = time.perf_counter()
    optimizer.step()
    module.lazy_reset_grad()
    t2 = time.perf_counter()
    fb.append(t1 - t0)
    upd.append(t2 - t1)
print(json.dumps({"fb": float(np.mean(fb[warmup:])), "upd": float(np.mean(upd[warmup:]))}))
"""


def make_run(root: Path, steps: int, display: int):
    """A configured, sharded run of the bench GPT (ortflow.examples.gpt: d 256, 4 layers, seq 128, batch 8)."""
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data
    from ortflow.examples.gpt import build_gpt

    root.mkdir(parents=True, exist_ok=True)
    model, corpus = root / "gpt.onnx", root / "corpus.txt"
    if not model.exists():
        build_gpt(model, seq_len=128, d_model=256, num_layers=4, num_heads=4)
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "ortflow").rglob("*.py"))))
    cfg = config_from_dict({
        "name": "overhead", "output_dir": str(root / "run"), "model": {"path": str(model)},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": 128}},
        "train": {"batch_size": 8, "num_train_steps": steps, "display_loss_steps": display, "evaluation_period": 0,
                  "max_eval_rows": 8},
        "checkpoint": {"period": 0, "max_num_checkpoints": 1},
        "distributed": {"num_ranks": 1, "threads_per_rank": 1},
    })  # fmt: skip
    configure(cfg)
    prepare_data(cfg)
    return cfg


def bare(cfg, steps: int, warmup: int) -> dict:
    """The bare loop's mean forward+backward and update seconds per update after warm-up."""
    out = subprocess.run([PYTHON, "-c", BARE, str(cfg.output_dir), str(steps), str(warmup)], capture_output=True,
                         text=True, env=ENV, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def trainer(cfg, display: int, skip_windows: int) -> dict:
    """The trainer's mean seconds per update of each phase over its windows after the warm-up ones."""
    shutil.rmtree(cfg.checkpoints_dir, ignore_errors=True)
    cmd = [MPIEXEC, "-n", "1", PYTHON, "-u", "-m", "ortflow.trainer", str(cfg.output_dir)]
    subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True)
    windows = json.loads((cfg.output_dir / "timing.json").read_text())["windows"][skip_windows:]
    return {p: float(np.mean([w[p] for w in windows])) / display for p in windows[0]}


def measure(rounds: int, steps: int, warmup_windows: int, display: int, root: Path) -> dict:
    cfg = make_run(root, steps, display)
    rows = {"added": [], "engine": [], "wall": [], "bare_ms": [], "trainer_ms": [], "phases": []}
    for r in range(rounds):
        order = ("bare", "trainer") if r % 2 == 0 else ("trainer", "bare")
        got = {name: (bare(cfg, steps, warmup_windows * display) if name == "bare" else
                      trainer(cfg, display, warmup_windows)) for name in order}  # fmt: skip
        b, t = got["bare"], got["trainer"]
        bare_s = b["fb"] + b["upd"]
        trainer_s = sum(v for p, v in t.items() if p not in ("eval", "checkpoint"))
        outside = trainer_s - t["forward_backward"] - t["update"]  # the trainer's own time, outside engine calls
        rows["added"].append(outside / bare_s)
        rows["engine"].append((t["forward_backward"] + t["update"]) / bare_s - 1)
        rows["wall"].append(trainer_s / bare_s - 1)
        rows["bare_ms"].append(bare_s * 1000)
        rows["trainer_ms"].append(trainer_s * 1000)
        rows["phases"].append({p: v * 1000 for p, v in t.items()})
        print(f"round {r}: bare {bare_s * 1000:.1f} ms, trainer {trainer_s * 1000:.1f} ms, added "
              f"{rows['added'][-1] * 100:+.2f}%, engine {rows['engine'][-1] * 100:+.2f}%, "
              f"wall {rows['wall'][-1] * 100:+.2f}%", flush=True)  # fmt: skip
    return rows


def spread(values) -> str:
    return " / ".join(f"{v * 100:+.2f}%" for v in (np.min(values), np.median(values), np.max(values)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench overhead")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=50, help="updates per run (a multiple of --display)")
    parser.add_argument("--display", type=int, default=10)
    parser.add_argument("--warmup-windows", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ortflow-bench-overhead"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    started = time.time()
    rows = measure(args.rounds, args.steps, args.warmup_windows, args.display, args.work)
    load_end = os.getloadavg()
    phases = {p: float(np.median([r[p] for r in rows["phases"]])) for p in rows["phases"][0]}
    command = (f"python -m bench overhead --rounds {args.rounds} --steps {args.steps} --display {args.display} "
               f"--warmup-windows {args.warmup_windows}")  # fmt: skip
    lines = [
        f"# Trainer overhead at 1 x 1, per-phase counters ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})", "",
        f"{os.cpu_count()} cores; load average (1, 5, 15 min) at start {[round(x, 2) for x in load_start]}, at end "
        f"{[round(x, 2) for x in load_end]}; {args.rounds} interleaved rounds, {time.time() - started:.0f} s.", "",
        "| figure | min / median / max over rounds |", "|---|---|",
        f"| added by the trainer (counters; goal <= 1%) | {spread(rows['added'])} |",
        "| engine calls (forward+backward + optimizer step), trainer vs bare (paired, cross-process) | "
        f"{spread(rows['engine'])} |",
        f"| wall per update, trainer vs bare (paired, cross-process) | {spread(rows['wall'])} |",
        "", "Per update, median over rounds (ms): bare "
        f"{np.median(rows['bare_ms']):.1f}, trainer {np.median(rows['trainer_ms']):.1f}; trainer phases: "
        + ", ".join(f"{p} {v:.3f}" for p, v in phases.items()),
    ]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"overhead-{os.uname().nodename}-{time.strftime('%Y%m%d-%H%M', time.gmtime())}"
        write_result(args.out / stem, {"command": command, "load_start": load_start, "load_end": load_end, **rows},
                     text)


if __name__ == "__main__":
    main()
