"""Adasum convergence experiment: the same samples and learning rate for 1 rank, 4 ranks averaged, 4 ranks Adasum.

With a fixed per-rank batch, 4 averaging ranks take a quarter of the updates of 1 rank for the same samples, each
on a 4x larger batch: at the learning rate tuned for 1 rank they fall behind unless the rate is retuned. Adasum
adds the orthogonal parts of the ranks' contributions, so it keeps closer to the 1-rank curve at the same rate.

    python -m bench adasum [--out bench/out] [--samples 9600]

Writes ``adasum.json`` (loss against samples for every contender, final eval loss, ms per update) and
``adasum.png`` (the curves) into ``--out``. CPU only; each contender is a real ``mpiexec`` run of the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.examples.mlp import build_mlp

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def make_data(root: Path, rows: int = 12000, features: int = 16) -> Path:
    """A noisy nonlinear 4-class problem (so the loss keeps falling over the whole run)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    w = rng.normal(size=(features, 4))
    logits = np.tanh(x @ w) * 3 + 0.5 * rng.normal(size=(rows, 4))
    np.savez(root / "data.npz", features=x, labels=logits.argmax(1).astype(np.int64))
    return root / "data.npz"


def contender(root: Path, name: str, ranks: int, adasum: bool, optimizer: dict, samples: int, batch: int):
    """Configure and shard one run; returns its config."""
    model = root / "mlp.onnx"
    if not model.exists():
        build_mlp(model, num_features=16, hidden=64, num_classes=4, seed=0)
    steps = samples // (batch * ranks)
    raw = {
        "name": name, "output_dir": str(root / name), "model": {"path": str(model)},
        "data": {"train": [str(root / "data.npz")], "eval_fraction": 0.2},
        "train": {"batch_size": batch, "num_train_steps": steps, "display_loss_steps": 1, "evaluation_period": 0,
                  "seed": 0},
        "optimizer": optimizer,
        "distributed": {"num_ranks": ranks, "enable_adasum": adasum, "threads_per_rank": 1},
        "checkpoint": {"period": 0, "max_num_checkpoints": 1},
    }
    cfg = config_from_dict(raw)
    configure(cfg)
    prepare_data(cfg)
    return cfg


def scalars(cfg, tag: str) -> list[tuple[int, float]]:
    """(update, value) of one TensorBoard scalar of the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(cfg.tensorboard_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def run(cfg) -> float:
    """Train; returns the wall seconds of the job."""
    start = time.perf_counter()
    proc = subprocess.run([MPIEXEC, "-n", str(cfg.distributed.num_ranks), sys.executable, "-m", "ortflow.trainer",
                           str(cfg.output_dir)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    if proc.returncode:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/ortflow-bench-adasum"))
    parser.add_argument("--samples", type=int, default=9600)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    make_data(args.work)
    optimizers = {"sgd": {"name": "sgd", "learning_rate": 0.1}, "adamw": {"name": "adamw", "learning_rate": 0.003}}
    layouts = [("1 rank", 1, False), ("4 ranks mean", 4, False), ("4 ranks adasum", 4, True)]
    report = {"samples": args.samples, "batch_per_rank": args.batch, "command": " ".join(sys.argv), "results": []}
    for opt_name, opt in optimizers.items():
        for label, ranks, adasum in layouts:
            cfg = contender(args.work, f"{opt_name}-{ranks}-{'adasum' if adasum else 'mean'}", ranks, adasum, opt,
                            args.samples, args.batch)
            run(cfg)
            curve = scalars(cfg, "train/loss")
            # The trainer's own throughput (training time only, not start-up, eval or checkpoints), per update.
            rates = [v for _, v in scalars(cfg, "train/samples_per_s")[5:]]
            from ortflow.checkpoints import list_complete

            final = list_complete(cfg.checkpoints_dir)[-1]
            per_update = args.batch * ranks
            report["results"].append({
                "optimizer": opt_name, "contender": label, "ranks": ranks, "adasum": adasum, "lr": opt["learning_rate"],
                "updates": final.step, "final_eval_loss": final.eval_loss,
                "final_train_loss": float(np.mean([v for _, v in curve[-10:]])),
                "ms_per_update": 1000 * per_update / float(np.median(rates)),
                "curve": [(s * per_update, v) for s, v in curve],
            })
            r = report["results"][-1]
            print(f"{opt_name:6s} {label:15s} updates {final.step:5d} eval loss {final.eval_loss:.4f} "
                  f"ms/update {r['ms_per_update']:.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adasum.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "adasum.png")


def plot(report: dict, path: Path) -> None:
    """Loss against samples, one panel per optimizer (needs the bench extra's matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (make bench installs it): no plot")
        return
    names = sorted({r["optimizer"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4))
    for ax, name in zip(np.atleast_1d(axes), names, strict=True):
        for r in (r for r in report["results"] if r["optimizer"] == name):
            xs, ys = zip(*r["curve"], strict=True)
            window = max(1, len(ys) // 40)  # smoothed over ~1/40 of the run so the curves are readable
            smooth = np.convolve(ys, np.ones(window) / window, mode="valid")
            ax.plot(xs[window - 1 :], smooth, label=f"{r['contender']} (eval {r['final_eval_loss']:.3f})")
        ax.set_title(f"{name}, lr {r['lr']}, batch {report['batch_per_rank']}/rank")
        ax.set_xlabel("samples")
        ax.set_ylabel("train loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
