"""Helpers that make real, tiny run folders (configured and sharded) for the trainer's tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from ortflow.config import RunConfig, config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.examples.mlp import build_mlp

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def make_run(root: Path, name: str, *, num_rows: int = 512, model: Path | None = None, model_fields: dict | None = None,
             **sections) -> RunConfig:
    """Configure + shard an MLP classifier run under ``root/name``; ``sections`` override config sections and
    ``model_fields`` the model section's fields other than its path."""
    root.mkdir(parents=True, exist_ok=True)
    model = model or root / "mlp.onnx"
    if not model.exists():
        build_mlp(model, num_features=8, hidden=16, num_classes=3, seed=0)
    data = root / "data.npz"
    if not data.exists():
        rng = np.random.default_rng(0)
        features = rng.normal(size=(num_rows, 8)).astype(np.float32)
        labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
        np.savez(data, features=features, labels=labels)
    raw = {
        "name": name,
        "output_dir": str(root / name),
        "model": {"path": str(model), **(model_fields or {})},
        "data": {"train": [str(data)], "eval_fraction": 0.125, "rows_per_shard": 100},
        "train": {"batch_size": 4, "num_train_steps": 20, "display_loss_steps": 1, "evaluation_period": 0},
        "optimizer": {"learning_rate": 0.01},
        "checkpoint": {"period": 5, "max_num_checkpoints": 2},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    cfg = config_from_dict(raw)
    configure(cfg)
    prepare_data(cfg)
    return cfg


def copied_run(source, make, root: Path, name: str, **sections):
    """``make(root, name, **sections)`` in a folder that holds a copy of ``source``'s configured artifacts (a run of
    the same model and layout: the same configure fingerprint): configure verifies the copies against the copied
    record and reuses them, recording their new place, instead of building them again."""
    from ortflow.configure.configure import CONFIGURE_RECORD_NAME, configure
    from ortflow.configure.torch_model import TORCH_MODEL_DIR

    target = root / name
    target.mkdir(parents=True)
    for folder in ("artifacts", TORCH_MODEL_DIR):
        if (source.output_dir / folder).is_dir():
            shutil.copytree(source.output_dir / folder, target / folder)
    shutil.copy2(source.output_dir / CONFIGURE_RECORD_NAME, target / CONFIGURE_RECORD_NAME)
    cfg = make(root, name, **sections)
    again = configure(cfg)
    assert again.reused and again.info["artifacts_dir"] == str(cfg.artifacts_dir), again.info["artifacts_dir"]
    return cfg


def rank_command(cfg: RunConfig, script: str | None = None, *args: str) -> list[str]:
    """mpiexec command for the run's ranks: the real entry point, or a test script wrapping it."""
    target = [script, *args] if script else ["-m", "ortflow.trainer"]
    return [MPIEXEC, "-n", str(cfg.distributed.num_ranks), "-prepend-rank", sys.executable, "-u", *target,
            str(cfg.output_dir)]


def run_ranks(
    cfg: RunConfig, script: str | None = None, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the job to its end; output (both streams) in ``.stdout``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        rank_command(cfg, script, *args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=timeout, env=env, stdin=subprocess.DEVNULL, check=False,
    )


def final_parameters(cfg: RunConfig) -> dict[str, np.ndarray]:
    """Trainable parameters of the newest checkpoint of a run."""
    from ortflow.checkpoints import list_complete

    return checkpoint_parameters(list_complete(cfg.checkpoints_dir)[-1].path)


def checkpoint_parameters(folder: Path) -> dict[str, np.ndarray]:
    """Trainable parameters of one checkpoint folder (a run without pipeline stages)."""
    import h5py

    with h5py.File(folder / "params.h5", "r") as f:  # plain h5py: one dataset per parameter
        return {ds.attrs["name"]: ds[()] for ds in f["parameters"].values() if ds.attrs["requires_grad"]}


def make_text_run(root: Path, name: str, **sections) -> RunConfig:
    """Configure + shard a tiny byte-level GPT run on text (ortflow's own sources) under ``root/name``."""
    from ortflow.examples.gpt import build_gpt

    root.mkdir(parents=True, exist_ok=True)
    model = root / "gpt.onnx"
    if not model.exists():
        build_gpt(model, seq_len=16, d_model=32, num_layers=1, num_heads=2)
    corpus = root / "corpus.txt"
    if not corpus.exists():
        sources = sorted((Path(__file__).resolve().parents[2] / "ortflow").rglob("*.py"))[:6]
        corpus.write_text("\n".join(p.read_text() for p in sources))
    base = {"data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": 16}, "eval_fraction": 0.05}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return make_run(root, name, model=model, **base)


def kill_when(cfg: RunConfig, proc: subprocess.Popen, min_step: int) -> int:
    """SIGKILL the whole job once progress shows ``min_step`` updates; returns the step seen."""
    import signal
    import time

    import pytest

    from ortflow.trainer.metrics import read_progress

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        progress = read_progress(cfg.output_dir)
        if progress and progress["step"] >= min_step:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return progress["step"]
        if proc.poll() is not None:
            pytest.fail("the job ended before it could be killed")
        time.sleep(0.002)
    pytest.fail("no progress within 60 s")


def kill_and_resume(cfg: RunConfig, min_step: int, end_step: int, timeout: float = 120) -> str:
    """Start the job, SIGKILL it past ``min_step`` updates, check it was cut between checkpoints before
    ``end_step``, run it again and check that it resumed from its newest checkpoint; returns the resumed output."""
    from ortflow.checkpoints import list_complete

    proc = subprocess.Popen(rank_command(cfg), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    kill_when(cfg, proc, min_step)
    before = [info.step for info in list_complete(cfg.checkpoints_dir)]
    assert before and max(before) < end_step, before  # interrupted between checkpoints, before the end
    resumed = run_ranks(cfg, timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout
    assert f"starting from step {max(before)}" in resumed.stdout
    return resumed.stdout
