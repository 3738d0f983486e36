"""The large-model path (weights in external data: configure, training, checkpoints, export) on a tiny Llama.

A model past 2 GB cannot be written in CI; the 2 GB limit is a parameter of configure and export, lowered here to
one byte so that the tiny model takes the same path as a 1B one: the engine gets the graph with its weights left in
their files, and export writes ``model.onnx`` plus ``model.onnx.data``; cut into pipeline stages, each stage reaches
the engine the same way and trains, resumes and exports as the same stages built under the limit; split into
tensor-parallel pieces (alone or within pipeline stages), each weight a piece slices is read alone from its file, the
slices reach the engine in a data file of the piece's own, and the pieces train and export as those built under the
limit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.engine import api
from ortflow.export.model import export_model
from ortflow.graph.exports.external_data import INLINE_BYTES
from ortflow.graph.prepare import CONSTANT_ELEMENTS
from tests.support.exports import export_path
from tests.support.runs import final_parameters, run_ranks
from tools.make_large_llama import PRESETS, LlamaShape, write_model

TINY = PRESETS["tiny"]


def _reference_logits(weights: dict[str, np.ndarray], s: LlamaShape, ids: np.ndarray) -> np.ndarray:
    """Hugging Face's Llama forward in numpy (float64)."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    hd, t = s.head_dim, ids.shape[1]

    def norm(x, name):
        return w[name] * x / np.sqrt((x * x).mean(-1, keepdims=True) + s.eps)

    inv = 1.0 / s.rope_theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(t), inv)] * 2, -1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rope(x):
        return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    def heads(x, n):
        return x.reshape(*x.shape[:2], n, hd).transpose(0, 2, 1, 3)

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(s.layers):
        p = f"model.layers.{i}."
        h = norm(x, p + "input_layernorm.weight")
        q = rope(heads(h @ w[p + "self_attn.q_proj.weight"].T, s.heads))
        k = rope(heads(h @ w[p + "self_attn.k_proj.weight"].T, s.kv_heads)).repeat(s.heads // s.kv_heads, 1)
        v = heads(h @ w[p + "self_attn.v_proj.weight"].T, s.kv_heads).repeat(s.heads // s.kv_heads, 1)
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        merged = (probs @ v).transpose(0, 2, 1, 3).reshape(*x.shape)
        x = x + merged @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, p + "post_attention_layernorm.weight")
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, "model.norm.weight") @ w["lm_head.weight"].T


def test_make_large_llama_writes_a_llama_forward_with_every_weight_in_the_data_file(tmp_path):
    shape = LlamaShape(d_model=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=50)
    summary = write_model(tmp_path / "m.onnx", shape, seed=3)
    graph_only = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert {t.name for t in graph_only.graph.initializer} == {n for n, _ in shape.weights()}
    assert all(t.external_data and not t.raw_data for t in graph_only.graph.initializer)
    assert summary["num_parameters"] == shape.num_parameters() == sum(int(np.prod(d)) for _, d in shape.weights())
    loaded = onnx.load(str(tmp_path / "m.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    ids = np.random.default_rng(0).integers(0, shape.vocab, (2, 7))
    got = onnxruntime.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"input_ids": ids})[0]
    np.testing.assert_allclose(got, _reference_logits(weights, shape, ids), rtol=1e-4, atol=1e-4)


def test_the_1b_preset_has_about_1_1b_parameters_past_the_proto_limit():
    assert 1.05e9 < PRESETS["1b"].num_parameters() < 1.15e9
    assert PRESETS["600m"].num_parameters() * 4 > 2**31  # the smaller model past 2 GB


def _llama_run(tmp_path: Path, name: str = "run", **sections):
    """A run of the tiny Llama (written once under ``tmp_path``), ``sections`` merged into its config."""
    model = tmp_path / "llama" / "llama.onnx"
    if not model.exists():
        write_model(model, TINY, seed=1)
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(" ".join(f"token{i % 37}" for i in range(3000)))
    base = {
        "name": "large", "output_dir": str(tmp_path / name),
        "model": {"path": str(model), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": 16}, "eval_fraction": 0.05},
        "train": {"batch_size": 2, "num_train_steps": 2, "display_loss_steps": 1, "evaluation_period": 0},
        "optimizer": {"name": "adamw", "learning_rate": 1e-3},
        "checkpoint": {"period": 2},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return config_from_dict(base), model


def test_a_model_past_the_proto_limit_configures_trains_checkpoints_and_exports_with_external_data(tmp_path):
    cfg, model = _llama_run(tmp_path)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    before = sorted(p.name for p in model.parent.iterdir())
    result = configure(cfg, proto_limit=1)  # as if the model were past 2 GB
    assert sorted(p.name for p in model.parent.iterdir()) == before  # nothing written beside the user's model
    assert not any(p.name.endswith(".data") for p in result.artifacts_dir.iterdir())  # the links are gone
    state = api.CheckpointState.load_checkpoint(str(result.artifacts_dir / "checkpoint"))
    stored = {name: np.array(p.data, copy=True) for name, p in state.parameters}
    assert {n: v.tobytes() for n, v in stored.items()} == {n: v.tobytes() for n, v in weights.items()}

    prepare_data(cfg)
    done = run_ranks(cfg, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    trained = final_parameters(cfg)
    assert set(trained) == set(weights) and any(not np.array_equal(trained[n], weights[n]) for n in weights)

    out = tmp_path / "export" / "model.onnx"
    exported = export_model(cfg.output_dir, out, proto_limit=1)
    assert exported.verification.max_abs_diff["logits"] <= exported.verification.tolerance
    large = {n for n, v in weights.items() if v.nbytes >= INLINE_BYTES}  # the norm weights stay in the model file
    assert (out.parent / "model.onnx.data").stat().st_size == sum(weights[n].nbytes for n in large)
    graph_only = onnx.load(str(out), load_external_data=False)
    assert {t.name for t in graph_only.graph.initializer if t.external_data} == large
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    got = onnxruntime.InferenceSession(str(out)).run(["logits"], {"input_ids": ids})[0]
    expected = _reference_logits(trained, TINY, ids)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


PP2 = {"distributed": {"num_ranks": 2, "pipeline_parallel_size": 2}, "train": {"num_train_steps": 4},
       "checkpoint": {"period": 2, "max_num_checkpoints": 3}}


def _engine_calls(monkeypatch) -> list[dict]:
    """What every engine build of this process gets: the folder it runs in (and what lies there), where it writes,
    which initializers of its model hold their values (not references into a data file), which of those hold more
    than ``CONSTANT_ELEMENTS`` values, and the data file each of the others points into."""
    from ortflow.engine import artifacts as engine_artifacts

    calls, real = [], engine_artifacts.generate_artifacts

    def spy(model, *args, **kwargs):
        loaded = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL or t.raw_data]
        calls.append({"cwd": Path.cwd(), "there": sorted(p.name for p in Path.cwd().iterdir()),
                      "folder": Path(kwargs["artifact_directory"]), "loaded": [t.name for t in loaded],
                      "loaded_large": [t.name for t in loaded if np.prod(t.dims) > CONSTANT_ELEMENTS],
                      "initializers": [t.name for t in model.graph.initializer],
                      "external": {t.name: e.value for t in model.graph.initializer for e in t.external_data
                                   if e.key == "location"}})
        return real(model, *args, **kwargs)

    monkeypatch.setattr(engine_artifacts, "generate_artifacts", spy)
    return calls


def _stage_checkpoints(cfg) -> list[dict[str, bytes]]:
    folders = sorted((cfg.artifacts_dir / "stages").glob("stage-*"))
    states = [api.CheckpointState.load_checkpoint(str(f / "checkpoint")) for f in folders]
    return [{n: np.array(p.data, copy=True).tobytes() for n, p in state.parameters} for state in states]



def _train_both_alike(large, small, weights: dict) -> dict:
    """Train the run configured past the limit and its twin under it side by side; both end at the same parameters,
    bit for bit, and away from ``weights`` (the initial ones). Returns the trained parameters."""
    from ortflow.checkpoints import list_complete
    from ortflow.checkpoints.h5state import read_params
    from tests.support.runs import run_ranks_together

    prepare_data(large)
    prepare_data(small)
    for done in run_ranks_together(large, small, timeout=300):
        assert done.returncode == 0, done.stdout[-3000:]
    trained = read_params(list_complete(large.checkpoints_dir)[-1].path)
    reference = read_params(list_complete(small.checkpoints_dir)[-1].path)
    assert set(trained) == set(weights) and any(not np.array_equal(trained[n], weights[n]) for n in weights)
    assert {n: v.tobytes() for n, v in trained.items()} == {n: v.tobytes() for n, v in reference.items()}
    return trained


def _exports_in_files(cfg, out: Path, weights: dict, trained: dict) -> None:
    """Export past the limit writes ``model.onnx`` + ``model.onnx.data`` (every initializer of ``INLINE_BYTES`` or
    more in the data file), verified, whose logits are the numpy Llama's on the ``trained`` parameters."""
    exported = export_model(cfg.output_dir, out, proto_limit=1)
    assert exported.verification.max_abs_diff["logits"] <= exported.verification.tolerance
    outside = {n for n, v in weights.items() if v.nbytes >= INLINE_BYTES}
    assert (out.parent / "model.onnx.data").stat().st_size == sum(weights[n].nbytes for n in outside)
    graph_only = onnx.load(str(out), load_external_data=False)
    assert {t.name for t in graph_only.graph.initializer if t.external_data} == outside
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    got = onnxruntime.InferenceSession(str(out)).run(["logits"], {"input_ids": ids})[0]
    np.testing.assert_allclose(got, _reference_logits(trained, TINY, ids), rtol=1e-4, atol=1e-4)

def test_pipeline_stages_of_a_model_past_the_limit_build_train_resume_and_export_as_under_the_limit(
        tmp_path, monkeypatch):
    from ortflow.checkpoints import list_complete
    from ortflow.checkpoints.h5state import read_params
    from tests.support.runs import copied_run, run_ranks_together

    large, model = _llama_run(tmp_path, "large", **PP2)
    small, _ = _llama_run(tmp_path, "small", **PP2)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    data_files = sorted(p.name for p in model.parent.iterdir() if p != model)
    calls = _engine_calls(monkeypatch)
    configure(large, proto_limit=1)  # as if the model were past 2 GB: the stages are cut with their weights in files
    stage_calls = [c for c in calls if c["folder"].name.startswith("stage-")]
    assert [c["folder"].name for c in stage_calls] == ["stage-00", "stage-01"]
    for call in stage_calls:  # each stage's engine run: in its folder, the data files linked there, no weight loaded
        assert call["cwd"] == call["folder"] and set(data_files) <= set(call["there"])
        assert {n for n in call["loaded"] if weights[n].size > CONSTANT_ELEMENTS} == set()
        assert any(weights[n].size > CONSTANT_ELEMENTS for n in call["initializers"])
    assert not any(p.suffix == ".data" for p in (large.artifacts_dir / "stages").rglob("*"))  # the links are gone
    configure(small)  # under the limit: the weights loaded, the batch pass run
    # The same cuts and stages, each stage's checkpoint the user's weights bit for bit.
    assert json.loads((large.artifacts_dir / "stages" / "stages.json").read_text()) == \
        json.loads((small.artifacts_dir / "stages" / "stages.json").read_text())
    held = _stage_checkpoints(large)
    assert held == _stage_checkpoints(small)
    assert {n: v for stage in held for n, v in stage.items()} == {n: v.tobytes() for n, v in weights.items()}

    trained = _train_both_alike(large, small, weights)

    # Resumed from the step-2 checkpoint, the run ends where the straight one did, bit for bit.
    middle = next(c.path for c in list_complete(large.checkpoints_dir) if c.step == 2)
    sections = {**PP2, "checkpoint": {**PP2["checkpoint"], "checkpoint_to_load_path": str(middle)}}
    resumed = copied_run(large, lambda root, name, **s: _llama_run(root, name, **s)[0], tmp_path, "resumed",
                         **sections)
    prepare_data(resumed)
    (done,) = run_ranks_together(resumed, timeout=300)
    assert done.returncode == 0 and "starting from step 2" in done.stdout, done.stdout[-3000:]
    again = read_params(list_complete(resumed.checkpoints_dir)[-1].path)
    assert {n: v.tobytes() for n, v in again.items()} == {n: v.tobytes() for n, v in trained.items()}

    _exports_in_files(large, tmp_path / "export" / "model.onnx", weights, trained)  # the stages' parameters


def _piece_checkpoints(folder: Path) -> dict[str, dict[str, bytes]]:
    """Every piece's engine checkpoint under ``folder``, by the piece folder's path: parameter name -> bytes."""
    states = {str(f.relative_to(folder)): api.CheckpointState.load_checkpoint(str(f / "checkpoint"))
              for f in sorted(folder.rglob("piece-*"))}
    return {k: {n: np.array(p.data, copy=True).tobytes() for n, p in state.parameters} for k, state in states.items()}


@pytest.mark.parametrize(("layout", "folder", "record"), [
    ({"num_ranks": 2, "horizontal_parallel_size": 2}, "tensor", "tensor.json"),
    ({"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}, "pipetensor", "pipetensor.json"),
], ids=["tp", "pp_x_tp"])
def test_tensor_parallel_pieces_of_a_model_past_the_limit_build_from_the_data_files_and_train_as_under_the_limit(
        tmp_path, monkeypatch, layout, folder, record):

    large, model = _llama_run(tmp_path, "large", distributed=layout)
    small, _ = _llama_run(tmp_path, "small", distributed=layout)
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    data_files = sorted(p.name for p in model.parent.iterdir() if p != model)
    calls = _engine_calls(monkeypatch)
    configure(large, proto_limit=1)  # as if the model were past 2 GB: each weight sliced alone from its file
    piece_calls = [c for c in calls if c["folder"].name.startswith("piece-")]
    assert len(piece_calls) == len(list((large.artifacts_dir / folder).rglob("piece-*"))) > 0
    records = json.loads((large.artifacts_dir / folder / record).read_text())
    sliced = {n for split in [records, *records.get("stages", [])] for n in split.get("slicing", {})}
    in_files = {n: f for c in piece_calls for n, f in c["external"].items()}
    for call in piece_calls:  # no weight held in the proto; a piece reading data files runs in its folder, by them
        assert call["loaded_large"] == []
        assert not call["external"] or (call["cwd"] == call["folder"]
                                        and set(call["external"].values()) <= set(call["there"]))
    # The replicated weights stay in the user's files; the slices (new arrays) reach the engine in a data file of the
    # piece's own.
    assert set(in_files) == {n for n, v in weights.items() if v.size > CONSTANT_ELEMENTS} and sliced
    assert {n for n, f in in_files.items() if f in data_files} == set(in_files) - sliced
    assert all(f not in data_files for n, f in in_files.items() if n in sliced)
    assert not any(p.suffix == ".data" for p in (large.artifacts_dir / folder).rglob("*"))  # removed after the build
    configure(small)  # under the limit: the weights loaded, then sliced
    # The same split and pieces, each piece's checkpoint the same slices bit for bit.
    assert json.loads((large.artifacts_dir / folder / record).read_text()) == \
        json.loads((small.artifacts_dir / folder / record).read_text())
    held = _piece_checkpoints(large.artifacts_dir / folder)
    assert held == _piece_checkpoints(small.artifacts_dir / folder)
    assert {n for piece in held.values() for n in piece} == set(weights)

    trained = _train_both_alike(large, small, weights)

    _exports_in_files(large, tmp_path / "export" / "model.onnx", weights, trained)  # the merged slices


LAYOUTS = {"dp": {}, "pp2": {"num_ranks": 2, "pipeline_parallel_size": 2},
           "tp2": {"num_ranks": 2, "horizontal_parallel_size": 2}}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("export", ["llama-dynamo.onnx", "llama.onnx"])
def test_a_real_export_on_the_large_model_path_builds_the_checkpoints_it_builds_under_the_limit(tmp_path, export,
                                                                                               layout):
    """The Hugging Face Llama from both torch exporters (dynamo's weights in its external data, TorchScript's held
    in the proto), whole, in pipeline stages and in tensor-parallel pieces: every engine checkpoint the same."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a tiny corpus")

    def run(name, **limit):
        cfg = config_from_dict({
            "name": name, "output_dir": str(tmp_path / name),
            "model": {"path": str(export_path(export)), "loss": "cross_entropy", "label_input": "labels"},
            "data": {"train": [str(corpus)], "format": "text", "text": {"seq_len": 8}},
            "train": {"batch_size": 2, "num_train_steps": 1},
            "distributed": LAYOUTS[layout],
        })
        folder = configure(cfg, **limit).artifacts_dir
        found = {}
        for checkpoint in sorted(folder.rglob("checkpoint")):
            state = api.CheckpointState.load_checkpoint(str(checkpoint))
            found[str(checkpoint.relative_to(folder))] = {n: np.array(p.data, copy=True).tobytes()
                                                          for n, p in state.parameters}
        return found

    large = run("large", proto_limit=1)  # the weights left in the exporter's file (or written out of the proto)
    assert large == run("small") and (len(large) > 1) == (layout != "dp")  # the whole model's, and each part's


def test_planning_a_tensor_parallel_split_of_a_model_past_the_limit_reads_no_weight(tmp_path, monkeypatch):
    """validate and configure check how the pieces are cut before anything is built: from the slices' dims alone."""
    from ortflow.configure.tensor_parallel_artifacts import plan_tensor_parallel
    from ortflow.graph.tensor_parallel import tensor_shard

    cfg, _ = _llama_run(tmp_path, distributed={"num_ranks": 2, "horizontal_parallel_size": 2})
    read = []
    monkeypatch.setattr(tensor_shard, "weight_values", lambda tensor, folder: read.append(tensor.name))
    _, plan, _, _ = plan_tensor_parallel(cfg, proto_limit=1)
    assert plan.slicing() and read == []
