"""``ortflow evaluate`` on any checkpoint (``initial`` included), ``ortflow export --checkpoint initial``, and the one
eval loss that evaluate, export, the checkpoint and the training log quote for a checkpoint."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from ortflow.checkpoints import list_complete
from ortflow.cli import app
from ortflow.dataprep import EvalLoader
from ortflow.export.evaluate import evaluate_checkpoint
from tests.support.batch_models import reshape_batch_classifier
from tests.support.runs import make_run, make_text_run, run_ranks


def reference(model_path, cfg) -> tuple[float, float, int]:
    """Mean cross-entropy and accuracy of an inference model over the run's eval rows, in float64 numpy."""
    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    losses, hits = [], []
    for feeds, real in EvalLoader(cfg.data_dir, cfg.train.resolved_eval_batch_size, 0, 1).batches():
        z = session.run(["logits"], {"features": feeds["features"]})[0][:real].astype(np.float64)
        y = feeds["labels"][:real]
        z -= z.max(axis=1, keepdims=True)
        losses.append(np.log(np.exp(z).sum(axis=1)) - z[np.arange(real), y])
        hits.append(z.argmax(axis=1) == y)
    return float(np.concatenate(losses).mean()), float(np.concatenate(hits).mean()), len(np.concatenate(losses))


def cli(*args: str) -> dict:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1]) if args[0] == "evaluate" else {}


def test_initial_weights_evaluate_and_export_before_any_training(tmp_path):
    cfg = make_run(tmp_path, "run", train={"eval_batch_size": 5})  # 64 eval rows: the last batch is short
    said = CliRunner().invoke(app, ["export", str(cfg.output_dir), "--checkpoint", "initial", "-o",
                                    str(tmp_path / "initial.onnx")])
    assert said.exit_code == 0, said.output
    assert "(step 0, no eval loss recorded in training)" in said.output, said.output  # not "eval loss None"
    exported = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "initial.onnx")).graph.initializer}
    for tensor in onnx.load(str(cfg.model.path)).graph.initializer:  # the configured weights, bit for bit
        assert exported[tensor.name].tobytes() == numpy_helper.to_array(tensor).tobytes(), tensor.name
    loss, accuracy, rows = reference(tmp_path / "initial.onnx", cfg)
    result = cli("evaluate", str(cfg.output_dir), "--checkpoint", "initial")
    assert result["step"] == 0 and result["num_rows"] == rows == 64
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    assert result["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert not list_complete(cfg.checkpoints_dir)  # nothing was trained or written


def test_a_fixed_batch_model_evaluates_every_row_once(tmp_path):
    model = reshape_batch_classifier(batch=4, path=tmp_path / "fixed.onnx")
    del model
    cfg = make_run(tmp_path, "run", num_rows=90, model=tmp_path / "fixed.onnx", data={"eval_fraction": 0.1})
    cli("export", str(cfg.output_dir), "--checkpoint", "initial", "-o", str(tmp_path / "initial.onnx"))
    loss, accuracy, rows = reference(tmp_path / "initial.onnx", cfg)
    result = evaluate_checkpoint(cfg.output_dir, "initial")
    assert result.num_rows == rows == 9  # 2 full batches of 4 and one padded batch with 1 real row
    assert result.loss == pytest.approx(loss, rel=2e-6) and result.accuracy == pytest.approx(accuracy)


@pytest.mark.mpi
def test_a_trained_checkpoint_evaluates_to_the_loss_training_recorded(tmp_path):
    cfg = make_run(tmp_path, "run", train={"eval_batch_size": 5, "num_train_steps": 10})
    out = run_ranks(cfg)
    assert out.returncode == 0, out.stdout
    final = list_complete(cfg.checkpoints_dir)[-1]
    result = evaluate_checkpoint(cfg.output_dir, "latest")
    assert result.step == final.step == 10 and result.num_rows == 64
    assert result.loss == final.eval_loss  # the same batches, added by the same rule
    initial = evaluate_checkpoint(cfg.output_dir, "initial")
    assert initial.loss > result.loss  # training lowered it


@pytest.mark.mpi
@pytest.mark.parametrize("train,distributed", [
    ({"num_train_steps": 2, "eval_batch_size": 3}, {}),  # 104 eval rows: each rank's share ends in a short batch
    ({"num_train_steps": 2, "batch_size": 8, "global_batch_size": 12}, {}),  # ranks train on 6, evaluate on 8
    ({"num_train_steps": 4, "gradient_accumulation_steps": 2, "eval_batch_size": 3},  # the last stage sums the batches
     {"pipeline_parallel_size": 2}),
], ids=["eval_batch_size", "global_batch_size", "pipeline"])
def test_evaluate_and_export_quote_one_eval_loss_for_a_checkpoint_trained_on_two_ranks(tmp_path, train, distributed):
    cfg = make_text_run(tmp_path, "run", train=train, distributed={"num_ranks": 2, **distributed})
    out = run_ranks(cfg)
    assert out.returncode == 0, out.stdout
    final = list_complete(cfg.checkpoints_dir)[-1]
    evaluated = cli("evaluate", str(cfg.output_dir), "--checkpoint", "latest")
    exported = CliRunner().invoke(app, ["export", str(cfg.output_dir), "--checkpoint", "latest", "-o",
                                        str(tmp_path / "model.onnx")])
    assert exported.exit_code == 0, exported.output
    quoted = re.search(r"eval loss (\S+) as training recorded it", exported.output)
    stamped = {p.key: p.value for p in onnx.load(str(tmp_path / "model.onnx")).metadata_props}
    logged = json.loads((cfg.output_dir / "progress.json").read_text())
    assert evaluated["step"] == final.step == logged["step"] == 2 and stamped["step"] == "2"
    assert quoted is not None, exported.output
    assert repr(evaluated["loss"]) == quoted.group(1) == stamped["eval_loss"] == repr(final.eval_loss) \
        == repr(logged["eval_loss"])


def test_an_unknown_checkpoint_lists_the_ones_there(tmp_path):
    cfg = make_run(tmp_path, "run")
    result = CliRunner().invoke(app, ["evaluate", str(cfg.output_dir), "--checkpoint", "step-7"])
    assert result.exit_code == 1
    assert "no " in result.output and "step-00000007" in result.output and "'initial'" in result.output
    result = CliRunner().invoke(app, ["export", str(cfg.output_dir)])
    assert result.exit_code == 1 and "--checkpoint initial" in result.output
