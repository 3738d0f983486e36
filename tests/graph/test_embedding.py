"""The repeatable-gather pass (ortflow/graph/gradients/embedding.py) on export-shaped models
(tests/support/embedding_models.py): what it rewrites, that the forward is bit for bit the user's, that the engine's
gradients equal those of the unrewritten graph within fp32 rounding, that they repeat with 2 threads, and that export
gets the user's Gather back.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.configure.engine_input import repeatable_gathers
from ortflow.engine import api
from ortflow.graph.gradients.embedding import MARK, deterministic_gathers, restore_gathers
from ortflow.trainer.runtime import session_options
from tests.support.embedding_models import tied_lm

TRAINED = {"wte.weight", "wpe.weight", "mix.weight", "ln_1.weight", "ln_1.bias", "fc.weight", "fc.bias",
           "ln_f.weight", "ln_f.bias"}  # seg.weight is not trained: its Gather must stay


def _gathers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    found = collections.defaultdict(list)
    for node in model.graph.node:
        if node.op_type in ("Gather", "GatherND"):
            found[node.op_type].append(node)
    return found


@pytest.mark.parametrize("ids_type", [TensorProto.INT64, TensorProto.INT32])
def test_only_axis0_gathers_of_trained_parameters_become_gathernd(tmp_path, ids_type):
    original = onnx.load(str(tied_lm(tmp_path / "lm.onnx", ids_type=ids_type)))
    report: list[dict] = []
    model = deterministic_gathers(original, TRAINED, report)
    found = _gathers(model)
    (nd,) = found["GatherND"]
    identity = next(n for n in model.graph.node if n.op_type == "Identity")
    assert nd.input[0] == identity.output[0] and identity.input[0] == "wte.weight"  # read through the Identity
    assert [a.i for a in nd.attribute if a.name == "batch_dims"] == [0]
    left = sorted(n.input[0] for n in found["Gather"])
    assert "seg.weight" in left and "mix.weight" in left and len(left) == 3  # frozen, axis 1, and a Shape's Gather
    casts = [n for n in model.graph.node if n.op_type == "Cast" and n.doc_string == MARK]
    assert len(casts) == (1 if ids_type == TensorProto.INT32 else 0)  # GatherND reads int64 ids only
    assert report == [{"pass": "deterministic_gathers", "changes": [
        f"Gather '{_gathers(original)['Gather'][0].name}' of parameter 'wte.weight' -> GatherND (repeatable CPU "
        "gradient)"]}]
    assert [t.name for t in model.graph.initializer] == [t.name for t in original.graph.initializer]
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("ids_type", [TensorProto.INT64, TensorProto.INT32])
def test_forward_is_bitwise_the_users_and_restore_gives_the_graph_back(tmp_path, ids_type):
    original = onnx.load(str(tied_lm(tmp_path / "lm.onnx", ids_type=ids_type)))
    rewritten = deterministic_gathers(original, TRAINED)
    restored = restore_gathers(rewritten)
    ids = np.random.default_rng(0).integers(0, 7, (3, 6)).astype(np.int32 if ids_type == TensorProto.INT32
                                                                     else np.int64)

    def logits(model):
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(["logits"], {"input_ids": ids})[0]

    assert np.array_equal(logits(rewritten), logits(original))
    assert [(n.op_type, list(n.input), list(n.output)) for n in restored.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in original.graph.node]
    assert restore_gathers(original) == original  # nothing marked: unchanged


def _configure(tmp_path, model, deterministic: bool, frozen=("seg.weight",)):
    cfg = config_from_dict({
        "output_dir": str(tmp_path / f"run-{deterministic}"),
        "model": {"path": str(model), "loss": "cross_entropy", "frozen": list(frozen)},
        "data": {"train": [str(tmp_path / "unused.npz")]}, "train": {"batch_size": 3, "num_train_steps": 1},
        "distributed": {"deterministic_compute": deterministic},
    })  # fmt: skip
    return cfg, configure(cfg).info


def _loss_and_grads(artifacts, inputs, threads):
    state = api.CheckpointState.load_checkpoint(str(artifacts / "checkpoint"))
    module = api.Module(str(artifacts / "training_model.onnx"), state, str(artifacts / "eval_model.onnx"),
                        device="cpu", session_options=session_options(threads, True))
    module.train()
    loss = float(module(*inputs))
    return loss, {name: np.array(p.grad, copy=True) for name, p in state.parameters if p.requires_grad}


@pytest.mark.parametrize("ids_type", [TensorProto.INT64, TensorProto.INT32])
def test_engine_gradients_equal_the_unrewritten_graphs(tmp_path, ids_type):
    model = tied_lm(tmp_path / "lm.onnx", ids_type=ids_type)
    (cfg_on, rec_on), (cfg_off, rec_off) = _configure(tmp_path, model, True), _configure(tmp_path, model, False)
    assert "deterministic_gathers" in [r["pass"] for r in rec_on["graph_rewrites"]]
    assert "deterministic_gathers" not in [r["pass"] for r in rec_off["graph_rewrites"]]
    ops = {run: collections.Counter(n.op_type for n in onnx.load(str(c.artifacts_dir / "training_model.onnx"))
                                    .graph.node) for run, c in (("on", cfg_on), ("off", cfg_off))}
    assert ops["on"]["GatherNDGrad"] == 1 and ops["off"]["GatherNDGrad"] == 0
    assert (ops["on"]["GatherGrad"], ops["off"]["GatherGrad"]) == (1, 2)  # mix.weight's axis-1 read stays a Gather
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 7, (3, 6))  # 18 ids over 7 rows: every row repeated
    inputs = [ids.astype(np.int32 if ids_type == TensorProto.INT32 else np.int64),
              rng.integers(0, 7, (3, 6)).astype(np.int64)]
    loss_on, grads_on = _loss_and_grads(cfg_on.artifacts_dir, inputs, 1)
    loss_off, grads_off = _loss_and_grads(cfg_off.artifacts_dir, inputs, 1)
    assert set(grads_on) == set(grads_off) == TRAINED
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    for name, want in grads_off.items():
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(grads_on[name], want, rtol=1e-5, atol=1e-6 * scale, err_msg=name)
    assert np.abs(grads_on["wte.weight"]).max() > 0  # both readers (Gather and the tied head) contribute


def test_gradients_repeat_bitwise_with_two_threads(tmp_path):
    from ortflow.examples.gpt import build_gpt

    model = build_gpt(tmp_path / "gpt.onnx", vocab_size=256, seq_len=16, d_model=64, num_layers=2, num_heads=2)
    cfg, _ = _configure(tmp_path, model, True, frozen=())
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, 4, (16, 16)), rng.integers(0, 256, 256)) for _ in range(6)]  # ids from 0..3

    def grads():
        state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
        module = api.Module(str(cfg.artifacts_dir / "training_model.onnx"), state,
                            str(cfg.artifacts_dir / "eval_model.onnx"), device="cpu",
                            session_options=session_options(2, True))
        module.train()
        out = []
        for ids, labels in batches:
            module.lazy_reset_grad()
            module(ids, labels)
            out.append(np.array(state.parameters["wte.weight"].grad).tobytes())
        return out

    assert grads() == grads()


def test_the_rewrite_follows_device_and_deterministic_compute(tmp_path):
    def cfg(**distributed):
        return config_from_dict({"output_dir": str(tmp_path), "model": {"path": str(tmp_path / "m.onnx")},
                                 "data": {"train": [str(tmp_path / "d.npz")]},
                                 "train": {"batch_size": 1, "num_train_steps": 1}, "distributed": distributed})

    assert repeatable_gathers(cfg())  # the default: CPU, deterministic_compute on
    assert not repeatable_gathers(cfg(deterministic_compute=False))
    assert not repeatable_gathers(cfg(device="cuda", use_nccl=True))  # the CUDA GatherGrad is another kernel


def test_pipeline_stages_get_the_rewrite_too(tmp_path):
    from ortflow.artifacts_folder import stage_dir
    from tests.support.mlp_stack import B, build_torchlike

    path = tmp_path / "m.onnx"
    build_torchlike(path, num_blocks=2)
    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(path), "pipeline_cuts": ["blocks.0.resid"]},
        "data": {"train": str(tmp_path / "train.parquet")}, "train": {"batch_size": B, "num_train_steps": 2},
        "distributed": {"num_ranks": 2, "pipeline_parallel_size": 2},
    })  # fmt: skip
    configure(cfg)
    ops = collections.Counter(n.op_type for n in onnx.load(str(stage_dir(cfg.artifacts_dir, 0) /
                                                                "training_model.onnx")).graph.node)
    assert ops["GatherNDGrad"] == 1 and ops["GatherGrad"] == 0  # stage 0 holds the token embedding



def test_bert_broadcast_position_embeddings_get_a_declared_shape_so_their_gradient_is_summed_over_the_batch():
    # BERT adds position embeddings [1, seq, C] (ids sliced from a buffer, first dim unknown to onnx's inference) to
    # [batch, seq, C]. Undeclared, the engine's Add gradient passes [batch, seq, C] on to the table's GatherGrad /
    # GatherNDGrad, which then reads batch times more ids than exist (wrong rows, writes past the buffer).
    import onnx as _onnx

    from ortflow.graph.prepare import prepare_model
    from tests.support.exports import export_path

    model = _onnx.load(str(export_path("bert.onnx")))
    trainable = {t.name for t in model.graph.initializer if t.data_type == _onnx.TensorProto.FLOAT}
    prepared = prepare_model(model, trainable, "cross_entropy", "logits", "labels", repeatable_gathers=True)
    graph = prepared.model.graph
    position = "/model/bert/embeddings/position_embeddings/Gather_output_0"
    (declared,) = [v for v in graph.value_info if v.name == position]
    assert [d.dim_value or d.dim_param for d in declared.type.tensor_type.shape.dim] == [1, "seq", 64]
    reads = {n.input[0].split(".")[-2]: n.op_type for n in graph.node
             if n.op_type in ("Gather", "GatherND") and n.input[0] in trainable}
    assert reads == {"word_embeddings": "GatherND", "token_type_embeddings": "GatherND",
                     "position_embeddings": "GatherND"}
