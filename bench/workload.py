"""The benchmark's workload: the PyTorch GPT exported to ONNX, token data, and one configured + sharded run folder.

The run folder is configured once; :func:`set_layout` re-configures it for another ranks x threads layout (the
engine's artifacts are reused: the distributed section is outside configure's fingerprint) and clears checkpoints,
so that every trainer run starts from the initial weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from bench.common import Setup, random_tokens
from ortflow.config import RunConfig, config_from_dict
from ortflow.trainer.metrics import PROGRESS_FILE

LEARNING_RATE = 1e-3
SEED = 0


def export_model(root: Path, shape: dict, seed: int = SEED) -> Path:
    """``root/gpt.onnx``: the PyTorch GPT of ``shape`` with its seed-``seed`` initial weights."""
    from bench.torch_gpt import GPT, GPTShape, export_onnx

    path = root / "gpt.onnx"
    if not path.exists():
        export_onnx(GPT(GPTShape(**shape), seed=seed), path)
    return path


def write_tokens(root: Path, shape: dict, rows: int, seed: int = SEED) -> Path:
    """``root/tokens.npz`` with ``input_ids`` and next-token ``labels`` windows [rows, seq_len]."""
    path = root / "tokens.npz"
    if not path.exists():
        tokens = random_tokens(rows, shape["seq_len"], shape["vocab_size"], seed)
        np.savez(path, input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    return path


def run_config(root: Path, setup: Setup, num_ranks: int, threads: int) -> RunConfig:
    """The trainer's config for one layout; timing windows are the progress line's display windows."""
    raw = {
        "name": "bench-gpt",
        "output_dir": str(root / "run"),
        "model": {"path": str(root / "gpt.onnx"), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(root / "tokens.npz")], "eval_fraction": 0.0, "rows_per_shard": 4096},
        "train": {
            # one window more than the others run: the final window also holds the end-of-run evaluation, so it is
            # not timed (bench.compare.trainer_step_time)
            "batch_size": setup.batch_size, "num_train_steps": setup.total_steps + setup.display_steps,
            "display_loss_steps": setup.display_steps, "evaluation_period": 0, "seed": SEED,
        },
        "optimizer": {"name": "adamw", "learning_rate": LEARNING_RATE},
        "lr_schedule": {"name": "constant"},
        "distributed": {"num_ranks": num_ranks, "threads_per_rank": threads},
        "checkpoint": {"period": 0, "max_num_checkpoints": 1},
    }  # fmt: skip
    return config_from_dict(raw)


def build(root: Path, setup: Setup, rows: int) -> RunConfig:
    """Export the model, write the tokens, configure and shard the run folder (1 x 1 layout)."""
    from ortflow.build.configure import configure
    from ortflow.dataprep import prepare_data

    root.mkdir(parents=True, exist_ok=True)
    export_model(root, setup.shape)
    write_tokens(root, setup.shape, rows)
    cfg = run_config(root, setup, 1, 1)
    configure(cfg)
    prepare_data(cfg)
    return cfg


def set_layout(root: Path, setup: Setup, num_ranks: int, threads: int) -> RunConfig:
    """Re-configure the run folder for ``num_ranks`` x ``threads`` and remove what a previous run left."""
    from ortflow.build.configure import configure

    cfg = run_config(root, setup, num_ranks, threads)
    result = configure(cfg)
    if not result.reused:
        raise RuntimeError("configure rebuilt the artifacts for a layout change; the bench expects reuse")
    shutil.rmtree(cfg.checkpoints_dir, ignore_errors=True)
    shutil.rmtree(cfg.tensorboard_dir, ignore_errors=True)
    (cfg.output_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return cfg
