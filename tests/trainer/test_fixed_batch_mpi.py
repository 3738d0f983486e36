"""A classifier whose graph hard-codes its batch dim trains on 2 ranks with the default eval_fraction.

Every eval row counts exactly once (short last batches are padded and weighted), and the eval loss the trainer
records equals the exported model's mean loss over the same rows.
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnxruntime
import pytest

from ortflow.checkpoints import list_complete
from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import EvalLoader, prepare_data, read_manifest
from ortflow.export import export_model
from tests.support.batch_models import classification_data, fixed_batch_classifier, reshape_batch_classifier
from tests.support.runs import run_ranks

pytestmark = pytest.mark.mpi
BATCH = 4


def cross_entropy_rows(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(labels)), labels]


@pytest.mark.parametrize(
    ("builder", "batch_size", "symbolic"),
    [
        (reshape_batch_classifier, BATCH, False),  # the graph hard-codes 4: batches of 4, short eval batches padded
        (fixed_batch_classifier, 7, True),  # exported with a fixed 4 the graph does not use: any batch size works
    ],
)
def test_fixed_batch_classifier_on_two_ranks_counts_every_eval_row_once(tmp_path, builder, batch_size, symbolic):
    model = tmp_path / "fixed.onnx"
    builder(batch=BATCH, path=model)
    features, labels = classification_data(110)
    np.savez(tmp_path / "data.npz", features=features, labels=labels)
    cfg = config_from_dict({
        "name": "fixed", "output_dir": str(tmp_path / "run"), "model": {"path": str(model)},
        "data": {"train": [str(tmp_path / "data.npz")]},  # default eval_fraction (0.1): 11 eval rows, 5 + 6 per rank
        "train": {"batch_size": batch_size, "num_train_steps": 10, "evaluation_period": 5},
        "optimizer": {"learning_rate": 0.01}, "distributed": {"num_ranks": 2},
        "checkpoint": {"period": 5},
    })  # fmt: skip
    record = configure(cfg).info
    assert record["batch"]["fixed_batch"] == BATCH and record["batch"]["symbolic"] is symbolic
    manifest = prepare_data(cfg)
    num_eval = manifest.num_rows("eval")
    assert num_eval == 11 and 5 % batch_size and 6 % batch_size  # both ranks (5 and 6 rows) end on a short batch

    out = run_ranks(cfg)
    assert out.returncode == 0, out.stdout
    counted = [int(n) for n in re.findall(r"\[0\].*eval loss \S+ over (\d+) rows", out.stdout)]
    assert counted == [num_eval, num_eval]  # two evaluations, each over every row exactly once
    final = list_complete(cfg.checkpoints_dir)[-1]
    assert final.step == 10 and final.eval_loss is not None

    exported = export_model(cfg.output_dir, tmp_path / "model.onnx").path
    session = onnxruntime.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    losses = []
    for feeds, real in EvalLoader(cfg.data_dir, batch_size, 0, 1).batches():
        logits = session.run(["logits"], {"features": feeds["features"]})[0]
        losses.append(cross_entropy_rows(logits[:real], feeds["labels"][:real]))
    rows = np.concatenate(losses)
    assert len(rows) == num_eval
    # float32 forward passes and the padded-batch correction (B*mean - (B-r)*loss): a few float32 ulps of the sum.
    np.testing.assert_allclose(final.eval_loss, rows.mean(), rtol=2e-6)
    declared = [BATCH, 8] if not symbolic else ["batch", 8]
    assert json.loads((cfg.output_dir / "configure.json").read_text())["train_inputs"][0]["shape"] == declared
    assert read_manifest(cfg.data_dir).inputs[0].shape == declared
