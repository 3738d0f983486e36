"""Is training with 2 threads per rank repeatable, with and without the GatherND rewrite? ``python -m
bench.embedding_repeat_mpi ROOT [PAIRS]``

The setting of tests/trainer/test_embedding_mpi.py (2 ranks under mpiexec, ``threads_per_rank: 2``, the demo-sized
byte GPT on text, 60 updates), trained twice per pair with ``distributed.deterministic_compute`` on (ortflow's
GatherND rewrite, ortflow/graph/embedding.py) and off (the engine's GatherGrad). Prints one ``RESULT`` line per
pair: whether both runs ended with bitwise identical parameters, and the largest difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

STEPS = 60


def make(root: Path, name: str, deterministic: bool):
    from ortflow.build.configure import configure
    from ortflow.config import config_from_dict
    from ortflow.dataprep import prepare_data
    from ortflow.examples.gpt import build_gpt

    model, corpus = root / "gpt.onnx", root / "corpus.txt"
    if not model.exists():
        build_gpt(model, vocab_size=256, seq_len=16, d_model=64, num_layers=2, num_heads=2)
        sources = sorted((Path(__file__).resolve().parents[1] / "ortflow").rglob("*.py"))[:6]
        corpus.write_text("\n".join(p.read_text() for p in sources))
    cfg = config_from_dict({
        "name": name, "output_dir": str(root / name), "model": {"path": str(model)},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": 16}, "eval_fraction": 0.05},
        "train": {"batch_size": 16, "num_train_steps": STEPS, "display_loss_steps": 5, "evaluation_period": 0},
        "optimizer": {"learning_rate": 0.01}, "checkpoint": {"period": STEPS},
        "distributed": {"num_ranks": 2, "threads_per_rank": 2, "deterministic_compute": deterministic},
    })  # fmt: skip
    configure(cfg)
    prepare_data(cfg)
    return cfg


def train(cfg) -> dict[str, np.ndarray]:
    from ortflow.checkpoints import list_complete

    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "ortflow.trainer", str(cfg.output_dir)], check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    with h5py.File(list_complete(cfg.checkpoints_dir)[-1].path / "params.h5", "r") as f:
        return {ds.attrs["name"]: ds[()] for ds in f["parameters"].values() if ds.attrs["requires_grad"]}


def main(root: Path, pairs: int) -> None:
    for pair in range(pairs):
        for deterministic in (True, False):
            a, b = (train(make(root, f"p{pair}-{deterministic}-{i}", deterministic)) for i in range(2))
            worst = max(float(np.abs(a[n] - b[n]).max()) for n in a)
            print("RESULT " + json.dumps({"pair": pair, "deterministic_compute": deterministic, "updates": STEPS,
                                          "identical": all(np.array_equal(a[n], b[n]) for n in a),
                                          "max_param_diff": worst}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
