"""Models whose weights live in external data files: the preparation pass never loads or moves the weights."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ortflow.build.configure import configure
from ortflow.build.engine_input import engine_input
from ortflow.engine import api, artifacts
from ortflow.graph.prepare import prepare_model
from tests import models_export
from tests.graph.test_export_patterns import make_cfg


def _external_model(tmp_path):
    model = onnx.load(str(models_export.layernorm_classifier(tmp_path / "base.onnx")))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    return path, weights


def _checkpoint_values(folder):
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    return {name: np.array(p.data, copy=True) for name, p in state.parameters}


def test_rewritten_model_with_external_data_keeps_its_weights(tmp_path):
    path, weights = _external_model(tmp_path)
    before = sorted(os.listdir(path.parent))
    result = configure(make_cfg(tmp_path, path))
    assert result.info["graph_rewrites"][0]["pass"] == "declare_optional_outputs"
    stored = _checkpoint_values(result.artifacts_dir)
    assert {n: v.tobytes() for n, v in stored.items()} == {n: v.tobytes() for n, v in weights.items()}
    assert sorted(os.listdir(path.parent)) == before  # nothing written beside the user's model


def test_a_prepared_model_over_the_proto_limit_goes_to_the_engine_as_a_file_in_scratch(tmp_path):
    path, weights = _external_model(tmp_path)
    graph_only = onnx.load(str(path), load_external_data=False)
    prepared = prepare_model(graph_only, set(weights), "cross_entropy", "logits", "labels")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    engine_path = engine_input(path, prepared, scratch, proto_limit=1)  # as if the model were over 2 GB
    assert isinstance(engine_path, str) and os.path.dirname(engine_path) == str(scratch)
    assert (scratch / "m.data").read_bytes() == (path.parent / "m.data").read_bytes()
    out = tmp_path / "artifacts"
    out.mkdir()
    cwd = os.getcwd()
    os.chdir(scratch)
    try:
        artifacts.generate_artifacts(engine_path, requires_grad=sorted(weights), frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=str(out))
    finally:
        os.chdir(cwd)
    stored = _checkpoint_values(out)
    assert {n: v.tobytes() for n, v in stored.items()} == {n: v.tobytes() for n, v in weights.items()}
