"""Models whose weights live in external data files: the preparation pass never loads or moves the weights."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from ortflow.configure.configure import configure
from ortflow.configure.engine_input import engine_input
from ortflow.engine import api, artifacts
from ortflow.graph.exports.external_data import needs_external_data
from ortflow.graph.prepare import prepare_model
from tests.graph.test_export_patterns import make_cfg
from tests.support.graph import layernorm_classifier


def _external_model(tmp_path):
    model = onnx.load(str(layernorm_classifier(tmp_path / "base.onnx")))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    return path, weights


def _checkpoint_values(folder):
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    return {name: np.array(p.data, copy=True) for name, p in state.parameters}



def _build_in(scratch, engine_model, trainable, out):
    """The engine's artifacts of ``engine_model`` built with ``scratch`` (where its data files lie) as the current
    folder, written to ``out``."""
    out.mkdir()
    with contextlib.chdir(scratch):
        artifacts.generate_artifacts(engine_model, requires_grad=trainable, frozen_params=[],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=None,
                                     artifact_directory=str(out))
    return out

def test_rewritten_model_with_external_data_keeps_its_weights(tmp_path):
    path, weights = _external_model(tmp_path)
    before = sorted(os.listdir(path.parent))
    result = configure(make_cfg(tmp_path, path))
    assert result.info["graph_rewrites"][0]["pass"] == "declare_optional_outputs"
    stored = _checkpoint_values(result.artifacts_dir)
    assert {n: v.tobytes() for n, v in stored.items()} == {n: v.tobytes() for n, v in weights.items()}
    assert sorted(os.listdir(path.parent)) == before  # nothing written beside the user's model


def test_a_prepared_model_over_the_proto_limit_reaches_the_engine_with_its_weights_in_linked_files(tmp_path):
    path, weights = _external_model(tmp_path)
    graph_only = onnx.load(str(path), load_external_data=False)
    prepared = prepare_model(graph_only, set(weights), "cross_entropy", "logits", "labels")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    engine_model, linked = engine_input(path, prepared, scratch, proto_limit=1)  # as if the model were over 2 GB
    assert linked == ["m.data"]
    assert (scratch / "m.data").read_bytes() == (path.parent / "m.data").read_bytes()
    assert all(t.external_data for t in engine_model.graph.initializer if t.name in weights)  # nothing loaded
    out = _build_in(scratch, engine_model, sorted(weights), tmp_path / "artifacts")
    stored = _checkpoint_values(out)
    assert {n: v.tobytes() for n, v in stored.items()} == {n: v.tobytes() for n, v in weights.items()}


def test_weights_held_in_a_graph_over_the_proto_limit_reach_the_engine_from_a_data_file_written_beside_the_links(
        tmp_path):
    """A tensor-parallel piece's slices are new arrays held in its proto, its replicated weights references: past the
    limit the held ones go to a data file of the piece's own, the engine reads both into the checkpoint."""
    model = onnx.load(str(layernorm_classifier(tmp_path / "base.onnx", features=10, hidden=12, classes=8)))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    graph_only = onnx.load(str(path), load_external_data=False)
    sliced = {"fc1.weight": weights["fc1.weight"] * 2, "fc2.weight": weights["fc2.weight"] + 1}  # held, > 64 values
    for t in graph_only.graph.initializer:
        if t.name in sliced:
            t.CopyFrom(numpy_helper.from_array(sliced[t.name], t.name))
    prepared = prepare_model(graph_only, set(weights), "cross_entropy", "logits", "labels")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    engine_model, linked = engine_input(path, prepared, scratch, proto_limit=1)  # as if the model were over 2 GB
    assert linked == ["m.data", "piece.data"]
    where = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in engine_model.graph.initializer}
    assert {n: where[n] for n in weights} == {n: "piece.data" if n in sliced else "m.data" for n in weights}
    assert (scratch / "m.data").read_bytes() == (path.parent / "m.data").read_bytes()  # the user's file as it was
    out = _build_in(scratch, engine_model, sorted(weights), tmp_path / "artifacts")
    expected = {**weights, **sliced}
    assert {n: v.tobytes() for n, v in _checkpoint_values(out).items()} == {n: v.tobytes() for n, v in expected.items()}


def test_a_prepared_model_under_the_proto_limit_reaches_the_engine_with_its_weights_loaded(tmp_path):
    path, weights = _external_model(tmp_path)
    prepared = prepare_model(onnx.load(str(path), load_external_data=False), set(weights), "cross_entropy", "logits",
                             "labels")
    engine_model, linked = engine_input(path, prepared, tmp_path, proto_limit=2**31 - 1)
    assert linked == []
    loaded = {t.name: numpy_helper.to_array(t) for t in engine_model.graph.initializer if t.name in weights}
    assert {n: v.tobytes() for n, v in loaded.items()} == {n: v.tobytes() for n, v in weights.items()}


@pytest.mark.parametrize(("proto", "data", "limit", "expected"), [
    (200_000, 2**31 - 200_002, 2**31 - 1, False),  # one byte under the limit
    (200_000, 2**31 - 200_001, 2**31 - 1, True),  # reaching it
    (10, 4_500_000_000, 2**31 - 1, True),  # the 1B Llama: 4.5 GB of weights
    (3_000_000_000, 0, 2**31 - 1, True),  # a graph alone past it (constants held in the proto)
    (1_000, 1_000, 1_500, True),  # a lowered limit
])
def test_the_external_data_decision_adds_graph_and_weight_bytes_against_the_limit(proto, data, limit, expected):
    assert needs_external_data(proto, data, limit) is expected


def test_the_model_size_is_summed_part_by_part_within_a_few_bytes_of_the_serialised_size(tmp_path):
    from ortflow.graph.exports.external_data import proto_bytes

    model = onnx.load(str(layernorm_classifier(tmp_path / "m.onnx")))
    exact = len(model.SerializeToString())
    assert exact <= proto_bytes(model) <= exact + 6 * (len(model.graph.node) + len(model.graph.initializer) + 20) + 64


def test_shape_inference_of_a_proto_holding_too_many_weight_bytes_reads_dims_only(monkeypatch):
    """A tensor-parallel rank's model of a model past 2 GB holds its slices of every split weight, more than protobuf
    serialises; shape inference then runs on a copy without the weights' values and finds the same types and shapes."""
    from ortflow.graph import onnx_tools
    from tests.support.tiny_lm import build_tiny_lm

    model = build_tiny_lm()

    def shapes(inferred):
        return {v.name: (v.type.tensor_type.elem_type, str(v.type.tensor_type.shape))
                for v in [*inferred.graph.value_info, *inferred.graph.output]}

    whole = onnx_tools.infer_shapes(model)
    assert all(t.raw_data or t.float_data for t in whole.graph.initializer)  # under the limit: onnx's own call
    monkeypatch.setattr(onnx_tools, "INFERENCE_HELD_BYTES", 1)
    light = onnx_tools.infer_shapes(model)
    assert shapes(light) == shapes(whole) and len(shapes(whole)) > 10
    large = [t for t in light.graph.initializer if np.prod(t.dims) > 64]
    assert large and not any(t.raw_data or t.float_data for t in large)  # the copy held no weight values
    assert all(t.raw_data or t.float_data for t in model.graph.initializer)  # the model itself is untouched
