"""The committed real exports (Hugging Face GPT-2 and BERT, the torch CNN with BatchNorm) trained through the
``ortflow`` CLI, for the GPU suite.

* ``configure ROOT MODEL PRECISION``: learnable synthetic data (GPT-2: each next token a fixed function of the
  previous one; BERT: the class is the first token modulo 3; CNN: the class is the image's mean brightness, in 10
  bands), a YAML config, then ``ortflow configure`` and
  ``ortflow prepare-data``, as a user runs them;
* ``train ROOT MODEL PRECISION``: ``ortflow train`` on the configured ranks (one by default); prints one ``RESULT``
  line with the first and final logged losses (from the run's progress record), the element type of the NCCL
  gradient all-reduce (or ZeRO-1 reduce-scatter) the ranks logged, and the seconds taken.

Every run of one model sees the same data in the same order, so the final losses of fp32, fp16 and bf16 compare.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXPORTS = REPO / "tests" / "fixtures" / "exports"
SEQ, ROWS, VOCAB, BATCH = 32, 2048, 512, 16
PRECISION = {"fp32": {}, "fp16": {"use_mixed_precision": True},
             "bf16": {"use_mixed_precision": True, "use_bfloat16": True}}  # fmt: skip


def _data(path: Path, model: str) -> None:
    rng = np.random.default_rng(0)
    if model == "gpt2":
        tokens = np.empty((ROWS, SEQ + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, VOCAB, ROWS)
        for t in range(SEQ):  # a fixed permutation of the vocabulary, with 10% random tokens as noise
            nxt = (tokens[:, t] * 37 + 11) % VOCAB
            noise = rng.random(ROWS) < 0.1
            tokens[:, t + 1] = np.where(noise, rng.integers(0, VOCAB, ROWS), nxt)
        np.savez(path, input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    elif model == "cnn":
        pixels = rng.normal(size=(ROWS, 1, 16, 16)).astype(np.float32)
        labels = (pixels.mean(axis=(1, 2, 3)) * 40).astype(np.int64).clip(-5, 4) + 5
        np.savez(path, pixels=pixels, labels=labels)
    else:
        ids = rng.integers(0, VOCAB, (ROWS, SEQ), dtype=np.int64)
        np.savez(path, input_ids=ids, attention_mask=np.ones_like(ids), labels=ids[:, 0] % 3)


def _cli(py: str, *args: str) -> None:
    out = subprocess.run([py, "-m", "ortflow", *args], capture_output=True, text=True, cwd=REPO)
    print(out.stdout[-3000:], out.stderr[-3000:], flush=True)
    if out.returncode != 0:
        raise SystemExit(f"ortflow {args[0]} failed with exit {out.returncode}")


def configure(args: argparse.Namespace) -> None:
    import yaml

    root = Path(args.root) / f"{args.model}-{args.precision}"
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data.npz"
    _data(data, args.model)
    cuda = args.device == "cuda"
    config = {
        "name": f"{args.model}-{args.precision}", "output_dir": str(root / "run"),
        "model": {"path": str(EXPORTS / f"{args.model}.onnx"), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(data)], "eval_fraction": 0.0},
        "train": {"batch_size": BATCH, "num_train_steps": args.steps, "display_loss_steps": 10,
                  "evaluation_period": 0},
        "optimizer": {"name": "adamw", "learning_rate": 1e-2 if args.model == "cnn" else 1e-3},
        "distributed": {"num_ranks": args.ranks, "device": args.device, "use_nccl": cuda,
                        "zero_stage": args.zero_stage},
        "checkpoint": {"period": 0},
        "precision": PRECISION[args.precision] if cuda else {},
    }  # fmt: skip
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    _cli(sys.executable, "configure", str(path))
    _cli(sys.executable, "prepare-data", str(path))


def train(args: argparse.Namespace) -> None:
    root = Path(args.root) / f"{args.model}-{args.precision}"
    start = time.perf_counter()
    out = subprocess.run([args.ortflow_py, "-m", "ortflow", "train", str(root / "run"), "--mpiexec",
                          args.mpiexec], capture_output=True, text=True, cwd=REPO)  # fmt: skip
    seconds = time.perf_counter() - start
    text = out.stdout + out.stderr
    print(text[-6000:], flush=True)
    losses = [float(x) for x in re.findall(r"step \d+/\d+ \| loss ([0-9.eE+-]+|nan|inf)", text)]
    progress_file = root / "run" / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.exists() else {}
    record = {"kind": "fixture", "model": args.model, "precision": args.precision, "seconds": round(seconds, 1),
              "steps": progress.get("step"), "final_loss": progress.get("loss", losses[-1] if losses else None),
              "first_logged_loss": losses[0] if losses else None, "logged_losses": losses,
              "exchange": sorted(set(re.findall(r"(?:gradient all-reduce|zero-1 reduce-scatter) in (\w+)", text))),
              "status": "ok" if out.returncode == 0 else "failed"}  # fmt: skip
    if out.returncode != 0:
        record["error"] = text[-2000:]
    print("RESULT " + json.dumps(record), flush=True)
    if out.returncode != 0:
        raise SystemExit(out.returncode)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("configure", "train"):
        p = sub.add_parser(name)
        p.add_argument("root")
        p.add_argument("model", choices=["gpt2", "bert", "cnn"])
        p.add_argument("precision", choices=sorted(PRECISION))
    c, t = sub.choices["configure"], sub.choices["train"]
    c.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    c.add_argument("--steps", type=int, default=60)
    c.add_argument("--ranks", type=int, default=1, help="data-parallel ranks, one GPU and a batch of 16 each")
    c.add_argument("--zero-stage", type=int, choices=[0, 1], default=0, help="distributed.zero_stage")
    t.add_argument("--ortflow-py", default=sys.executable)
    t.add_argument("--mpiexec", default="mpiexec")
    args = parser.parse_args(argv)
    {"configure": configure, "train": train}[args.cmd](args)


if __name__ == "__main__":
    main()
