"""The 1B Llama on GPUs: ortflow in fp16 and bf16 (data-parallel with ZeRO-1, or split in pipeline stages or by tensor
parallelism) against PyTorch FSDP2 + torch.compile.

Run through ``bench/large_llama.sh`` (one call does everything); the steps, each a subcommand:

* ``configure ROOT PRECISION [--layout dp|pp|tp] [--recompute]``: synthetic next-token data (each token a fixed
  function of the previous one, 10% noise), a YAML config (NCCL, the precision, the layout: ``dp`` data parallelism
  with ZeRO-1, ``pp`` one pipeline stage per GPU with 8 micro-batches per update, ``tp`` the model split over the GPUs
  by tensor parallelism; every layout trains ``gpus x batch`` sequences per update), ``ortflow configure`` and
  ``ortflow prepare-data``, as a user runs them, on the model ``tools/make_large_llama.py`` wrote into ROOT.
  ``--recompute`` (pp and tp): the same layout with ``distributed.recompute_forward: true`` in a run folder of its own
  (``...-recompute``), which takes the artifacts and shards of the layout's folder as hard links when that one is
  configured (recompute_forward is outside configure's fingerprint, so configure reuses them);
* ``train ROOT PRECISION [--layout ...] [--recompute]``: ``ortflow train`` on the configured GPUs; prints one
  ``RESULT`` line: the step time (median over the display windows of ``timing.json`` after the warm-up ones),
  tokens/s, the first and last logged losses (a ``--recompute`` contender is named "... (recompute)");
* ``report OUT``: reads every ``RESULT`` line of the logs in OUT (this script's and ``bench/torch_llama.py``'s) and
  writes ``large-llama.md`` and ``large-llama.json``: tokens/s and model FLOPs utilisation
  ``6 * parameters * tokens/s / (GPUs * peak)`` per contender, with the command, commit, GPUs and versions.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISION = {"fp16": {"use_mixed_precision": True},
             "bf16": {"use_mixed_precision": True, "use_bfloat16": True}}  # fmt: skip
#: Dense fp16/bf16 tensor-core peak of one H100/H200 SXM, TFLOP/s (NVIDIA's datasheet, without sparsity).
PEAK_TFLOPS = 989.0


def add_workload(parser: argparse.ArgumentParser) -> None:
    """The options every contender shares, so ortflow and PyTorch train the same workload."""
    parser.add_argument("--gpus", type=int, default=2, help="data-parallel ranks, one GPU each")
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU per update")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=14, help="updates in the run")
    parser.add_argument("--warmup", type=int, default=4, help="updates left out of the timing (session start)")
    parser.add_argument("--vocab", type=int, default=32000)


#: What each ortflow layout adds to ``distributed`` and how it names its contender; every layout trains
#: ``gpus x batch`` sequences per update (``train.global_batch_size``).
LAYOUTS = {"dp": ("ZeRO-1", lambda gpus: {"zero_stage": 1}),
           "pp": ("{gpus} pipeline stages", lambda gpus: {"pipeline_parallel_size": gpus}),
           "tp": ("tensor parallel {gpus}", lambda gpus: {"horizontal_parallel_size": gpus})}  # fmt: skip
PIPELINE_MICRO_BATCHES = 8


def _tokens(rows: int, seq: int, vocab: int):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = np.empty((rows, seq + 1), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, vocab, rows)
    for t in range(seq):
        noise = rng.random(rows) < 0.1
        tokens[:, t + 1] = np.where(noise, rng.integers(0, vocab, rows), (tokens[:, t] * 37 + 11) % vocab)
    return tokens


def run_name(precision: str, layout: str, recompute: bool = False) -> str:
    name = f"run-{precision}" if layout == "dp" else f"run-{precision}-{layout}"
    return name + "-recompute" if recompute else name


def contender(args: argparse.Namespace) -> str:
    """The report's name of an ortflow run: precision and layout, "(recompute)" for ``--recompute``."""
    name = f"ortflow {args.precision} " + LAYOUTS[args.layout][0].format(gpus=args.gpus)
    return name + " (recompute)" if getattr(args, "recompute", False) else name


def run_config(root: Path, precision: str, args: argparse.Namespace) -> dict:
    """The ortflow config of one precision's and layout's run (the model and data under ``root``)."""
    display, layout, recompute = 2, getattr(args, "layout", "dp"), getattr(args, "recompute", False)
    global_batch = args.gpus * args.batch
    micro = max(1, global_batch // PIPELINE_MICRO_BATCHES) if layout == "pp" else args.batch
    split = {"recompute_forward": bool(recompute)} if layout in ("pp", "tp") else {}  # kept or recomputed, not auto
    return {
        "name": f"llama-{precision}-{layout}" + ("-recompute" if recompute else ""),
        "output_dir": str(root / run_name(precision, layout, recompute)),
        "model": {"path": str(root / "llama.onnx"), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(root / "data.npz")], "eval_fraction": 0.0},
        "train": {"batch_size": micro, "global_batch_size": global_batch, "num_train_steps": args.steps,
                  "display_loss_steps": display, "evaluation_period": 0},
        "optimizer": {"name": "adamw", "learning_rate": 1e-4},
        "distributed": {"num_ranks": args.gpus, "device": "cuda", "use_nccl": True, **LAYOUTS[layout][1](args.gpus),
                        **split},
        "checkpoint": {"period": 0},
        "precision": PRECISION[precision],
    }  # fmt: skip


def _cli(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "ortflow", *args], capture_output=True, text=True, cwd=REPO)
    print(out.stdout[-3000:], out.stderr[-3000:], flush=True)
    if out.returncode != 0:
        raise SystemExit(f"ortflow {args[0]} failed with exit {out.returncode}")


def configure(args: argparse.Namespace) -> None:
    import numpy as np
    import yaml

    root = Path(args.root)
    data = root / "data.npz"
    if not data.exists():
        tokens = _tokens(args.gpus * args.batch * (args.steps + 1), args.seq, args.vocab)
        tmp = root / f"data-{args.precision}.npz"  # two precisions configure at once: one writes, rename is atomic
        np.savez(tmp, input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        tmp.replace(data)
    recompute = getattr(args, "recompute", False)
    path = root / f"config-{args.precision}-{args.layout}{'-recompute' if recompute else ''}.yaml"
    raw = run_config(root, args.precision, args)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    start = time.perf_counter()
    if recompute:  # the layout's own folder, when configured, holds the same artifacts
        sys.path.insert(0, str(REPO))
        from bench.common import link_configured
        from ortflow.config import config_from_dict

        kept = root / run_name(args.precision, args.layout)
        if link_configured(config_from_dict(raw), kept):
            print(f"linked the artifacts and data of {kept}", flush=True)
    _cli("configure", str(path))
    _cli("prepare-data", str(path))
    print(f"configured {contender(args)} in {time.perf_counter() - start:.1f} s", flush=True)


def step_time(timing: dict, display: int, warmup: int) -> float | None:
    """Median seconds per update over the display windows of ``timing.json`` that start after ``warmup`` updates."""
    windows = timing.get("windows") or []
    kept = [sum(w.values()) / display for i, w in enumerate(windows) if i * display >= warmup]
    return statistics.median(kept) if kept else None


def train(args: argparse.Namespace) -> None:
    root = Path(args.root)
    run = root / run_name(args.precision, args.layout, args.recompute)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "ortflow", "train", str(run), "--mpiexec", args.mpiexec],
                         capture_output=True, text=True, cwd=REPO)  # fmt: skip
    text = out.stdout + out.stderr
    print(text[-6000:], flush=True)
    losses = [float(x) for x in re.findall(r"step \d+/\d+ \| loss ([0-9.eE+-]+|nan|inf)", text)]
    timing = json.loads((run / "timing.json").read_text()) if (run / "timing.json").exists() else {}
    step = step_time(timing, run_config(root, args.precision, args)["train"]["display_loss_steps"], args.warmup)
    record = {"contender": contender(args), "precision": args.precision, "layout": args.layout,
              "recompute_forward": args.recompute, "gpus": args.gpus,
              "batch": args.batch, "seq": args.seq, "step_time_s": step,
              "tokens_per_s": args.gpus * args.batch * args.seq / step if step else None,
              "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
              "seconds": round(time.perf_counter() - start, 1),
              "status": "ok" if out.returncode == 0 and step else "failed"}  # fmt: skip
    if record["status"] != "ok":
        record["error"] = text[-2000:]
    print("RESULT " + json.dumps(record), flush=True)


def read_results(folder: Path) -> list[dict]:
    """Every ``RESULT {json}`` line of the ``*.log`` files in ``folder``, in file-name order."""
    found = []
    for log in sorted(Path(folder).glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("RESULT "):
                found.append(json.loads(line[len("RESULT "):]))
    return found


def mfu(tokens_per_s: float | None, parameters: int, gpus: int, peak_tflops: float) -> float | None:
    """Model FLOPs utilisation: ``6 * parameters * tokens/s`` against the GPUs' dense peak."""
    if not tokens_per_s:
        return None
    return 6 * parameters * tokens_per_s / (gpus * peak_tflops * 1e12)


def render(results: list[dict], meta: dict) -> str:
    """The markdown report: the provenance block, then one row per contender."""
    sys.path.insert(0, str(REPO))
    from bench.common import with_provenance

    params, peak = meta["parameters"], meta.get("peak_tflops", PEAK_TFLOPS)
    lines = [f"# 1B Llama on {meta.get('gpus', '?')} GPUs: ortflow against PyTorch FSDP2 + compile", "",
             f"Model: {params / 1e9:.2f}B parameters ({meta.get('shape', '')}); per GPU {meta.get('batch')} x "
             f"{meta.get('seq')} tokens per update. MFU = 6 x parameters x tokens/s / (GPUs x {peak:g} TFLOP/s).", ""]
    lines += ["| contender | status | step (ms) | tokens/s | MFU | first loss | last loss |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        util = mfu(r.get("tokens_per_s"), params, r.get("gpus", meta.get("gpus", 1)), peak)
        step, rate = r.get("step_time_s"), r.get("tokens_per_s")
        cells = [r["contender"], r.get("status", "?"), f"{step * 1e3:.1f}" if step else "-",
                 f"{rate:,.0f}" if rate else "-", f"{util:.1%}" if util is not None else "-",
                 _num(r.get("first_loss")), _num(r.get("last_loss"))]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in results if r.get("status") != "ok"]
    for r in failed:
        lines += ["", f"{r['contender']} failed:", "", "```", str(r.get("error", ""))[-1500:], "```"]
    return with_provenance("\n".join(lines), meta.get("command", "unknown"), meta)


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _probe(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable ({err})"


def run_meta(args: argparse.Namespace) -> dict:
    """The command, commit, GPUs, versions and workload the report names."""
    import importlib.metadata as metadata

    sys.path.insert(0, str(REPO))
    from bench.common import host
    from tools.make_large_llama import PRESETS

    versions = {}
    for name in ("onnxruntime-training", "onnxruntime", "onnx", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {**host(), "command": args.command,
            "gpu": _probe(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
            "versions": versions, "parameters": PRESETS[args.size].num_parameters(), "shape": args.size,
            "gpus": args.gpus, "batch": args.batch, "seq": args.seq, "peak_tflops": args.peak_tflops}


def report(args: argparse.Namespace) -> None:
    out = Path(args.out)
    meta = run_meta(args)
    results = read_results(out)
    (out / "large-llama.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "large-llama.md").write_text(render(results, meta))
    print(render(results, meta))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("configure", "train"):
        p = sub.add_parser(name)
        p.add_argument("root", help="the folder holding llama.onnx (tools/make_large_llama.py)")
        p.add_argument("precision", choices=sorted(PRECISION))
        p.add_argument("--layout", choices=sorted(LAYOUTS), default="dp",
                       help="dp: data parallelism with ZeRO-1; pp: a pipeline stage per GPU; tp: tensor parallelism")
        p.add_argument("--recompute", action="store_true",
                       help="pp, tp: stages and pieces recompute their forward (distributed.recompute_forward)")
        add_workload(p)
    sub.choices["train"].add_argument("--mpiexec", default="mpiexec")
    r = sub.add_parser("report")
    r.add_argument("out", help="the folder of the logs (and meta.json)")
    r.add_argument("--size", default="1b", help="the tools/make_large_llama.py preset the runs trained")
    r.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="one GPU's dense fp16/bf16 peak")
    r.add_argument("--command", default="bash bench/large_llama.sh", help="the command the report names")
    add_workload(r)
    args = parser.parse_args(argv)
    if getattr(args, "recompute", False) and args.layout == "dp":
        parser.error("--recompute is for the split layouts (--layout pp or tp)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    {"configure": configure, "train": train, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
