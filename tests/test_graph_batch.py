"""The batch-dimension pass (ortflow/graph/exports/batch_dims.py) on exporter-shaped graphs."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime

from ortflow.graph.exports.batch_dims import BATCH_DIM, make_batch_symbolic
from tests.support.batch_models import (
    batch_mean_classifier,
    fixed_batch_classifier,
    flattened_logits_model,
    reshape_batch_classifier,
    sequence_logits_model,
)


def leading(model: onnx.ModelProto) -> dict[str, int | str]:
    out = {}
    for info in [*model.graph.input, *model.graph.output]:
        dim = info.type.tensor_type.shape.dim[0]
        out[info.name] = dim.dim_value if dim.HasField("dim_value") else dim.dim_param
    return out


def run(model: onnx.ModelProto, features: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"features": features})[0]


def test_a_fixed_batch_the_graph_does_not_use_becomes_symbolic_and_runs_at_any_batch(caplog):
    model = fixed_batch_classifier(batch=4)
    before = model.SerializeToString()
    with caplog.at_level(logging.INFO, logger="ortflow.graph.exports.batch_dims"):
        out, report = make_batch_symbolic(model)
    assert model.SerializeToString() == before  # pure: the input is left as it was
    assert report.symbolic and report.fixed_batch == 4
    assert report.inputs == ("features",) and report.outputs == ("logits",)
    assert leading(out) == {"features": BATCH_DIM, "logits": BATCH_DIM}
    assert not out.graph.value_info  # the fixed intermediate shapes are gone
    assert [t.SerializeToString() for t in out.graph.initializer] == [t.SerializeToString() for t in
                                                                       model.graph.initializer]
    assert "made symbolic" in caplog.text
    x = np.random.default_rng(1).standard_normal((7, 8)).astype(np.float32)
    np.testing.assert_allclose(run(out, x)[:4], run(model, x[:4]), rtol=1e-6)


def test_a_batch_hard_coded_in_reshape_constants_stays_fixed():
    model = reshape_batch_classifier(batch=4)
    out, report = make_batch_symbolic(model)
    assert out is model
    assert not report.symbolic and report.fixed_batch == 4
    assert "fails at batch size 5" in report.reason


def test_a_graph_that_mixes_rows_stays_fixed_although_it_runs_at_other_sizes():
    out, report = make_batch_symbolic(batch_mean_classifier(batch=4))
    assert not report.symbolic
    assert "rows change with the batch size" in report.reason
    assert leading(out)["features"] == 4


def test_symbolic_or_batchless_models_are_returned_unchanged():
    model = sequence_logits_model(batch="B")
    out, report = make_batch_symbolic(model)
    assert out is model and report.fixed_batch is None and not report.symbolic


def test_a_fixed_batch_sequence_model_with_int_inputs_becomes_symbolic():
    out, report = make_batch_symbolic(sequence_logits_model(batch=3))
    assert report.symbolic
    assert leading(out) == {"input_ids": BATCH_DIM, "logits": BATCH_DIM}


def test_flattened_logits_become_a_multiple_of_the_symbolic_batch_and_train_at_another_size(tmp_path):
    from ortflow.config import config_from_dict
    from ortflow.configure.artifacts import build_artifacts
    from ortflow.engine import api

    out, report = make_batch_symbolic(flattened_logits_model(batch=2, seq=5))
    assert report.symbolic and leading(out) == {"input_ids": BATCH_DIM, "logits": f"{BATCH_DIM}*5"}
    flattened_logits_model(batch=2, seq=5, path=tmp_path / "gpt.onnx")
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path / "gpt.onnx")},
                            "data": {"train": "x"}, "train": {"batch_size": 3, "num_train_steps": 1}})  # fmt: skip
    built = build_artifacts(cfg, tmp_path / "artifacts")
    assert built.batch.symbolic
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "artifacts" / "checkpoint"))
    module = api.Module(str(tmp_path / "artifacts" / "training_model.onnx"), state,
                        str(tmp_path / "artifacts" / "eval_model.onnx"))  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 7, (3, 5))  # batch 3, traced at 2
    loss = float(module(ids, np.roll(ids, -1, axis=1).reshape(-1)))
    assert np.isfinite(loss) and loss > 0


def test_a_flattening_constant_that_holds_the_batch_keeps_it_fixed():
    out, report = make_batch_symbolic(flattened_logits_model(batch=2, seq=5, hard_coded=True))
    assert not report.symbolic and out.graph.output[0].type.tensor_type.shape.dim[0].dim_value == 10
