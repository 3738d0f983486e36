"""configure with precision.use_mixed_precision builds fp16/bf16 training graphs on any machine (they train on GPUs)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from ortflow.artifacts_folder import BACKPROP_SUFFIX, GRAD_IN_SUFFIX
from ortflow.config import config_from_dict
from ortflow.configure.artifacts import ArtifactsError, build_artifacts
from ortflow.configure.configure import configure
from ortflow.engine import api
from ortflow.graph.precision.cuda_kernels import missing_kernels
from ortflow.trainer.loss_scale import INPUT_NAME
from tests.support.tiny_lm import build_tiny_lm, save


def _cfg(tmp_path, model, **precision):
    return config_from_dict({
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(model), "loss": "cross_entropy"},
        "data": {"train": [str(tmp_path / "none.npz")]},
        "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"device": "cuda", "use_nccl": True},
        "precision": {"use_mixed_precision": True, **precision},
    })  # fmt: skip


def _inputs(path) -> dict[str, int]:
    return {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path), load_external_data=False).graph.input}


def test_fp16_artifacts_scale_the_loss_in_training_only_and_keep_fp32_master_weights(tmp_path):
    original = build_tiny_lm(flatten=True, full_layer_norm=True)
    cfg = _cfg(tmp_path, save(original, tmp_path / "lm.onnx"))
    configure(cfg)
    art = cfg.artifacts_dir
    train_inputs, eval_inputs = _inputs(art / "training_model.onnx"), _inputs(art / "eval_model.onnx")
    assert train_inputs[INPUT_NAME] == onnx.TensorProto.FLOAT and INPUT_NAME not in eval_inputs
    training = onnx.load(str(art / "training_model.onnx"))
    assert any(n.op_type == "Cast" and n.name.startswith("autocast/") for n in training.graph.node)
    record = json.loads((cfg.output_dir / "configure.json").read_text())
    assert [i["name"] for i in record["train_inputs"]] == ["input_ids", "labels"]  # the data stage's columns
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in original.graph.initializer}
    for name, param in state.parameters:
        assert param.data.dtype == np.float32 and np.array_equal(param.data, weights[name]), name


def test_bf16_artifacts_have_no_scale_input(tmp_path):
    cfg = _cfg(tmp_path, save(build_tiny_lm(flatten=True, full_layer_norm=True), tmp_path / "lm.onnx"),
               use_bfloat16=True)
    build_artifacts(cfg, cfg.artifacts_dir)
    assert INPUT_NAME not in _inputs(cfg.artifacts_dir / "training_model.onnx")
    training = onnx.load(str(cfg.artifacts_dir / "training_model.onnx"))
    assert any(n.op_type == "Cast" and any(a.name == "to" and a.i == onnx.TensorProto.BFLOAT16 for a in n.attribute)
               for n in training.graph.node)


def test_a_model_input_named_like_the_scale_is_refused(tmp_path):
    model = build_tiny_lm(flatten=True, full_layer_norm=True)
    model.graph.input[0].name = INPUT_NAME
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == "input_ids":
                node.input[i] = INPUT_NAME
    cfg = _cfg(tmp_path, save(model, tmp_path / "lm.onnx"))
    with pytest.raises(ArtifactsError, match=f"input named '{INPUT_NAME}'.*rename it"):
        build_artifacts(cfg, cfg.artifacts_dir)


def test_bf16_keeps_layer_normalization_fp32_even_when_fp32_ops_leaves_it_out(tmp_path):
    # With LayerNormalization in bf16 the CUDA engine fuses residual Add + LayerNormalization into a
    # SkipLayerNormalization with bf16 inputs, which it then refuses: bf16 keeps it fp32.
    model = save(build_tiny_lm(flatten=True, full_layer_norm=True), tmp_path / "lm.onnx")
    for precision, fp32_ln in (({"use_bfloat16": True}, True), ({}, False)):  # fp16 leaves it to the user
        cfg = _cfg(tmp_path / str(fp32_ln), model, fp32_ops=[], **precision)
        build_artifacts(cfg, cfg.artifacts_dir)
        graph = onnx.shape_inference.infer_shapes(onnx.load(str(cfg.artifacts_dir / "training_model.onnx")))
        types = {v.name: v.type.tensor_type.elem_type for v in (*graph.graph.value_info, *graph.graph.input)}
        norms = [n for n in graph.graph.node if n.op_type == "LayerNormalization"]
        assert norms
        for node in norms:
            assert (types[node.input[0]] == onnx.TensorProto.FLOAT) is fp32_ln, (precision, node.name)


SPLIT_CASES = [  # (export, layout, precision): both exporters, both layouts, both compute types
    ("gpt2-dynamo.onnx", "pp2", "fp16"), ("gpt2.onnx", "tp2", "bf16"),
    ("llama.onnx", "pp2", "bf16"), ("llama-dynamo.onnx", "tp2", "fp16"),
]


def _split_parts(cfg, layout: str) -> list[tuple[str, object, list[str]]]:
    """(label, folder, tensors it exchanges with the other parts) of every stage or piece configure built, the part
    that computes the loss last."""
    from ortflow.artifacts_folder import piece_dir, read_stages_record, read_tensor_record, stage_dir

    art = cfg.artifacts_dir
    if layout == "pp2":
        stages = read_stages_record(art)["stages"]
        return [(f"stage {s['index']}", stage_dir(art, s["index"]), s["receives"] + s["sends"]) for s in stages]
    pieces = read_tensor_record(art)["pieces"]  # the same pieces on every rank, each with its slices
    return [(f"rank {rank} piece {piece['index']}", piece_dir(art, rank, piece["index"]),
             piece["float_receives"] + piece["float_sends"]) for rank in range(2) for piece in pieces]


@pytest.mark.parametrize(("export", "layout", "precision"), SPLIT_CASES)
def test_each_stage_and_piece_is_autocast_alone_with_fp32_cut_tensors_and_the_scale_on_the_loss_only(
        tmp_path, export, layout, precision):
    """Pipeline stages and tensor-parallel pieces of the real exports in mixed precision: every training graph
    computes in the compute type, what crosses between parts stays fp32 (so no message changes type), and with fp16
    only the graph holding the loss takes the scale (no eval model does)."""
    from tests.trainer.exports_runs import gpt2_run, llama_run

    make = llama_run if export.startswith("llama") else gpt2_run
    split = {"pipeline_parallel_size": 2} if layout == "pp2" else {"horizontal_parallel_size": 2}
    compute = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[precision]
    cfg = make(tmp_path, "run", export=export,
               distributed={"num_ranks": 2, "device": "cuda", "use_nccl": True, **split},
               precision={"use_mixed_precision": True, "use_bfloat16": precision == "bf16"})
    configure(cfg)
    parts = _split_parts(cfg, layout)
    assert len(parts) >= 2, parts
    last = parts[-1][0].rsplit(" ", 1)[1]  # the last stage, or each tensor-parallel rank's last piece
    ends = {label for label, _, _ in parts if label.endswith(f" {last}") and (layout == "tp2" or label == parts[-1][0])}
    for label, folder, crossing in parts:
        training = onnx.load(str(folder / "training_model.onnx"), load_external_data=False)
        casts = [n for n in training.graph.node if n.op_type == "Cast" and n.name.startswith("autocast/")]
        assert any(a.name == "to" and a.i == compute for n in casts for a in n.attribute), label
        assert missing_kernels(training) == [], label  # every half node starts on the GPU engine (e.g. the LM
        # head's vocabulary Pad of a tensor-parallel rank has no bf16 CUDA kernel: it stays fp32)
        # What it receives or sends, and their gradients, in the training and eval graphs' inputs and outputs.
        graphs = [onnx.load(str(folder / f), load_external_data=False).graph
                  for f in ("training_model.onnx", "eval_model.onnx")]
        types = {v.name: v.type.tensor_type.elem_type for g in graphs for v in [*g.input, *g.output]}
        seen = {m: types[m] for n in crossing for m in (n, n + GRAD_IN_SUFFIX, n + BACKPROP_SUFFIX) if m in types}
        assert crossing and len(seen) >= len(crossing), (label, crossing, seen)
        declared = {m: t for m, t in seen.items() if t != onnx.TensorProto.UNDEFINED}  # exposed gradients: untyped
        assert declared and set(declared.values()) == {onnx.TensorProto.FLOAT}, (label, seen)
        takes_scale = INPUT_NAME in _inputs(folder / "training_model.onnx")
        assert takes_scale == (precision == "fp16" and label in ends), label
        assert INPUT_NAME not in _inputs(folder / "eval_model.onnx"), label
