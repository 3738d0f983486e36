"""Layouts at one global batch: ortflow ``--np auto`` against hand-picked layouts, PyTorch's default and PyTorch DDP.

Every contender trains the bench GPT (bench/torch_gpt.py, exported for ortflow) on the same number of samples per
weight update (``--global-batch``), so throughput is comparable whatever the layout:

* ``ortflow auto``: ``distributed.num_ranks: auto`` with ``train.global_batch_size``, the layout ``ortflow train``
  would start on this host (ortflow.launch.layout.launch_layout), started the same way;
* ``ortflow RxT``: hand-picked layouts with the same global batch (per-rank batch and accumulation derived);
* ``torch 1xC``: PyTorch's default, one process with all C cores as threads and the whole global batch;
* ``torch RxT``: PyTorch DDP (gloo) with R ranks of T threads, G / R samples per rank; ``torch RxT:MODE`` the same
  with ``torch.compile`` (``compile``), bf16 autocast (``bf16``) or both (``compile-bf16``); the best of these is
  "PyTorch at its best layout and mode".

Rounds interleave the contenders (order reversed every other round); figures are min / median / max over rounds of
the steady-state samples/s (warm-up updates excluded; for ortflow the progress windows after warm-up, the final
window excluded). Ratios are taken within a round.

Run: ``python -m bench layout --global-batch 16 --ortflow auto,1x2,2x1 --torch 1x2,2x1`` (on a many-core host, one
call per group of layouts keeps each call short).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

from bench.common import (
    Setup,
    default_mpiexec,
    host_info,
    parse_result,
    provenance,
    run_command,
    spawn_ranks,
    thread_env,
)
from bench.compare import LEARNING_RATE, SEED, export_model, write_tokens
from ortflow.config import config_from_dict, write_resolved_config
from ortflow.trainer.metrics import PROGRESS_FILE

SHAPE = {"vocab_size": 256, "seq_len": 128, "d_model": 256, "num_layers": 4, "num_heads": 4}
_PROGRESS = re.compile(r"step (\d+)/(\d+) \|.*?samples_per_s ([0-9.eE+-]+)")


def run_folder(root: Path, setup: Setup, global_batch: int, ranks: int | str, threads: int | None) -> object:
    """The ortflow run folder for one layout (configure and data preparation are reused between layouts)."""
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    raw = {
        "name": "bench-layout", "output_dir": str(root / "run"),
        "model": {"path": str(root / "gpt.onnx"), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(root / "tokens.npz")], "eval_fraction": 0.0, "rows_per_shard": 4096},
        "train": {"batch_size": setup.batch_size, "global_batch_size": global_batch,
                  "num_train_steps": setup.total_steps + setup.display_steps, "display_loss_steps": setup.display_steps,
                  "evaluation_period": 0, "seed": SEED},
        "optimizer": {"name": "adamw", "learning_rate": LEARNING_RATE},
        "distributed": {"num_ranks": ranks, "threads_per_rank": threads},
        "checkpoint": {"period": 0, "max_num_checkpoints": 1},
    }  # fmt: skip
    cfg = config_from_dict(raw)
    configure(cfg)
    prepare_data(cfg)
    write_resolved_config(cfg)
    shutil.rmtree(cfg.checkpoints_dir, ignore_errors=True)
    shutil.rmtree(cfg.tensorboard_dir, ignore_errors=True)
    (cfg.output_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return cfg


def ortflow_samples_per_s(output: str, setup: Setup) -> float | None:
    """Mean samples/s of the progress windows after warm-up (the final window, with the end-of-run eval, excluded)."""
    rates = [float(m[3]) for m in _PROGRESS.finditer(output)
             if int(m[1]) - setup.display_steps >= setup.warmup_steps and int(m[1]) < int(m[2])]  # fmt: skip
    return statistics.mean(rates) if rates else None


def run_ortflow(root: Path, setup: Setup, global_batch: int, layout: str, log: Path) -> dict:
    from ortflow.launch.layout import host_resources, launch_layout

    if layout == "auto":
        cfg = run_folder(root, setup, global_batch, "auto", None)
        chosen, _ = launch_layout(cfg, cfg.output_dir, host_resources())
        ranks, threads = chosen.ranks, chosen.threads
    else:
        ranks, threads = map(int, layout.split("x"))
        cfg = run_folder(root, setup, global_batch, ranks, threads)
    env = {**setup.env, **thread_env(threads), "ORTFLOW_THREADS_PER_RANK": str(threads),
           "ORTFLOW_NUM_RANKS": str(ranks)}  # fmt: skip
    cmd = [*setup.mpiexec, "-n", str(ranks), setup.python, "-u", "-m", "ortflow.trainer", str(cfg.output_dir)]
    code, out, _ = run_command(cmd, env, 900, log)
    return {"samples_per_s": ortflow_samples_per_s(out, setup) if code == 0 else None, "exit": code,
            "ranks": ranks, "threads": threads}  # fmt: skip


def run_torch(setup: Setup, global_batch: int, layout: str, log: Path) -> dict:
    """``layout`` is ``RxT`` or ``RxT:mode`` (a ``bench.workers`` PyTorch mode: eager, compile, bf16, compile-bf16)."""
    layout, _, mode = layout.partition(":")
    ranks, threads = map(int, layout.split("x"))
    per_rank = global_batch // ranks
    cmd = [setup.python, "-m", "bench.workers", "torch", "--shape", json.dumps(setup.shape), "--batch-size",
           str(per_rank), "--threads", str(threads), "--warmup", str(setup.warmup_steps),
           "--steps", str(setup.timed_steps), "--mode", mode or "eager"]  # fmt: skip
    code, out = spawn_ranks(cmd, ranks, {**setup.env, **thread_env(threads)}, 900)
    log.write_text(f"$ {' '.join(cmd)} (x{ranks} ranks)\n{out}\nexit {code}\n")
    result = parse_result(out) if code == 0 else None
    step = result["step_time_s"] if result else None
    return {"samples_per_s": global_batch / step if step else None, "exit": code, "ranks": ranks, "threads": threads}


def summary(values: list) -> list | None:
    kept = [v for v in values if v]
    return [min(kept), statistics.median(kept), max(kept)] if kept else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_layout")
    parser.add_argument("--global-batch", type=int, default=64, help="samples per weight update, every contender")
    parser.add_argument("--batch-size", type=int, default=16, help="ortflow's largest micro-batch per rank")
    parser.add_argument("--ortflow", default="auto", help="comma list: auto and/or RxT layouts")
    parser.add_argument("--torch", default="", help="comma list of RxT or RxT:MODE (MODE: eager, compile, bf16, "
                        "compile-bf16; 1xC eager is PyTorch's default)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="updates excluded (a multiple of --display)")
    parser.add_argument("--steps", type=int, default=6, help="timed updates (a multiple of --display)")
    parser.add_argument("--display", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/ortflow-bench-layout"))
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--name")
    args = parser.parse_args(argv)
    setup = Setup(SHAPE, args.batch_size, args.warmup, args.steps, args.display, default_mpiexec(),
                  env={"PYTHONUNBUFFERED": "1"})  # fmt: skip
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        export_model(args.work, SHAPE)
        model = "the PyTorch GPT of bench/torch_gpt.py, exported"
    except ModuleNotFoundError:  # no PyTorch on this machine: ortflow's own GPT of the same shape (ortflow only)
        if args.torch:
            raise
        from ortflow.examples.gpt import build_gpt

        build_gpt(args.work / "gpt.onnx", **SHAPE)
        model = "ortflow.examples.gpt (no PyTorch on this machine)"
    write_tokens(args.work, SHAPE, rows=max(4096, 4 * args.global_batch * (setup.total_steps + args.display)))
    info, started = {**host_info(), "model": model}, time.time()
    contenders = [("ortflow", x) for x in args.ortflow.split(",") if x] + [("torch", x) for x in args.torch.split(",")
                                                                           if x]  # fmt: skip
    name = args.name or f"layout-{info['host']}-{time.strftime('%Y%m%d-%H%M')}"
    logs = args.out / f"{name}-logs"
    runs: dict[str, list] = {f"{k} {x}": [] for k, x in contenders}
    for r in range(args.rounds):
        for kind, layout in contenders if r % 2 == 0 else contenders[::-1]:
            log = logs / f"round{r}" / f"{kind}-{layout}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            record = (run_ortflow(args.work, setup, args.global_batch, layout, log) if kind == "ortflow" else
                      run_torch(setup, args.global_batch, layout, log))  # fmt: skip
            runs[f"{kind} {layout}"].append({**record, "round": r})
            print(f"round {r + 1}/{args.rounds} {kind} {layout} ({record['ranks']}x{record['threads']}): "
                  f"{record['samples_per_s'] or 'FAILED'} samples/s", flush=True)  # fmt: skip
            # the report so far, after every contender: a run cut short by its time limit still leaves its results
            write_report(args, info, {k: v for k, v in runs.items() if v}, time.time() - started, name, quiet=True)
    write_report(args, info, runs, time.time() - started, name)


def _ratio(runs: dict, a: str, b: str) -> list | None:
    by_round = {x["round"]: x["samples_per_s"] for x in runs[b] if x["samples_per_s"]}
    return summary([x["samples_per_s"] / by_round[x["round"]] for x in runs[a]
                    if x["samples_per_s"] and x["round"] in by_round])  # fmt: skip


def write_report(args, info: dict, runs: dict, wall: float, name: str, quiet: bool = False) -> None:
    """``<name>.json`` and ``<name>.md``: per contender samples/s, and ortflow auto against the others."""
    rows = {label: {"samples_per_s": summary([x["samples_per_s"] for x in recs]),
                    "layout": f"{recs[0]['ranks']}x{recs[0]['threads']}"} for label, recs in runs.items()}  # fmt: skip
    torch_labels = [label for label in runs if label.startswith("torch") and rows[label]["samples_per_s"]]
    best_torch = max(torch_labels, key=lambda k: rows[k]["samples_per_s"][1], default=None)
    ratios = {}
    if "ortflow auto" in runs:
        for label in runs:
            if label != "ortflow auto" and runs[label]:
                ratios[f"ortflow auto / {label}"] = _ratio(runs, "ortflow auto", label)
    options = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if k not in ("out", "work") and v is not None]  # fmt: skip
    record = {"command": "python -m bench.bench_layout " + " ".join(options),
              "host": info, "load_average_at_end": os.getloadavg(), "global_batch": args.global_batch,
              "rows": rows, "best_torch": best_torch, "ratios": ratios, "runs": runs, "wall_s": wall}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=2))
    fmt = lambda v: " / ".join(f"{x:.2f}" for x in v) if v else "failed"  # noqa: E731
    lines = [f"# Layouts at global batch {args.global_batch}: {info['host']}, {info['cores']} cores, {info['date']}",
             "", *provenance(record["command"], info), "",
             f"Load average at end {record['load_average_at_end']}; {args.rounds} interleaved rounds, {wall:.0f} s. "
             f"Model: {info.get('model', '?')} {SHAPE}. Samples/s min / median "
             "/ max over rounds (every contender trains the same samples per weight update).", "",
             "| contender | ranks x threads | samples/s |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {label} | {row['layout']} | {fmt(row['samples_per_s'])} |" for label, row in rows.items()]
    if ratios:
        lines += ["", "| ratio (paired within rounds) | min / median / max |", "|---|---|"]
        lines += [f"| {k}{' (PyTorch best layout)' if best_torch and k.endswith(best_torch) else ''} | {fmt(v)} |"
                  for k, v in ratios.items()]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (args.out / f"{name}.md").write_text(text)
    if not quiet:
        print(text)


if __name__ == "__main__":
    main()
