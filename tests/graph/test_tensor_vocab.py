"""The tensor-parallel split of Gemm layers and of the vocabulary (embedding and tied LM head), one pass at a time."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortflow.graph.gradients.embedding import deterministic_gathers
from ortflow.graph.tensor_parallel.tensor_gemm import separate_gemm_biases
from ortflow.graph.tensor_parallel.tensor_pieces import cut_pieces
from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_split import describe, plan_tensor_parallel_split
from tests.support.gpt import gemm_tied_gpt, gpt2_style
from tests.support.tensor_sim import run_pieces, run_whole, trainable

VOCAB, WIDTH, SEQ = 32, 16, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpv") / "gemm_tied.onnx"
    gemm_tied_gpt(path, layers=1, width=WIDTH, heads=4, vocab=VOCAB, seq=SEQ, batch=2)
    raw = onnx.load(str(path))
    return separate_gemm_biases(raw, trainable(raw))  # what configure's export_fixes does first


def weights(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def test_gemm_mlp_splits_its_out_in_weights_on_the_swapped_axes_and_adds_the_row_bias_once(model):
    plan = plan_tensor_parallel_split(model, trainable(model), 2)
    mlp = next(r for r in plan.regions if r.columns == ["transformer.h.0.mlp.c_fc.weight"])
    assert mlp.rows == ["transformer.h.0.mlp.c_proj.weight"]
    assert mlp.transposed == ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]
    assert mlp.biases == ["transformer.h.0.mlp.c_fc.bias"]  # c_proj.bias: added once, after the all-reduce
    slicing = plan.slicing()
    # nn.Linear's [out, in]: columns of the product are rows of the weight, and the other way round
    assert slicing["transformer.h.0.mlp.c_fc.weight"] == (0, 1)
    assert slicing["transformer.h.0.mlp.c_proj.weight"] == (1, 1)
    assert slicing["transformer.h.0.mlp.c_fc.bias"] == (0, 1)
    assert "transformer.h.0.mlp.c_proj.bias" not in slicing
    whole, mine = weights(model), weights(shard_model(model, plan, 1))
    np.testing.assert_array_equal(mine["transformer.h.0.mlp.c_fc.weight"],
                                  whole["transformer.h.0.mlp.c_fc.weight"][2 * WIDTH:])
    np.testing.assert_array_equal(mine["transformer.h.0.mlp.c_proj.weight"],
                                  whole["transformer.h.0.mlp.c_proj.weight"][:, 2 * WIDTH:])
    assert mine["transformer.h.0.mlp.c_proj.bias"].shape == (WIDTH,)
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm" and "c_proj.weight" in n.input[1])
    assert list(gemm.input) == [gemm.input[0], "transformer.h.0.mlp.c_proj.weight"]  # bias taken out of the Gemm
    assert gemm.output[0] in mlp.outputs  # the partial product is what the ranks add


def test_a_gemm_with_its_bias_inside_is_kept_replicated_with_the_reason(tmp_path):
    path = gemm_tied_gpt(tmp_path / "raw.onnx", width=WIDTH, vocab=VOCAB, seq=SEQ)
    raw = onnx.load(str(path))
    plan = plan_tensor_parallel_split(raw, trainable(raw), 2)
    assert "a Gemm with transA, alpha or a bias input" in plan.kept["transformer.h.0.mlp.c_fc.weight"]
    assert "transformer.h.0.mlp.c_fc.weight" not in plan.slicing()


def test_tied_embedding_and_lm_head_slice_the_same_vocabulary_rows(model):
    plan = plan_tensor_parallel_split(model, trainable(model), 2)
    vocab = [r for r in plan.regions if r.vocab]
    assert [r.vocab for r in vocab] == [{"transformer.wte.weight": 0}] * 2  # Gather and MatMul(x, Transpose(wte))
    assert plan.slicing()["transformer.wte.weight"] == (0, 1)
    assert "transformer.wpe.weight" not in plan.slicing()  # positions: added whole, not a vocabulary
    assert any("vocabulary split of ['transformer.wte.weight'] (axis 0) in the LM head" in line
               for line in describe(plan))
    for rank in (0, 1):
        local = shard_model(model, plan, rank)
        table = weights(local)["transformer.wte.weight"]
        np.testing.assert_array_equal(table, weights(model)["transformer.wte.weight"][rank * 16:(rank + 1) * 16])
        out = local.graph.output[0]
        assert out.name == "logits" and [d.dim_value for d in out.type.tensor_type.shape.dim] == [2, SEQ, VOCAB]
        inferred = onnx.shape_inference.infer_shapes(local)  # the padded local logits are [B, T, V] again
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
        padded = vocab[1].outputs[0]
        assert shapes[padded] == [2, SEQ, VOCAB]


def test_pieces_with_the_vocabulary_split_compute_the_unsplit_logits(model):
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))
    ids[0, :4] = [0, 15, 16, 31]  # both ends of both ranks' rows
    # fp32: row-split products are added in another order (~ulps); the embedding sum itself is exact (x + 0)
    np.testing.assert_allclose(run_pieces(model, 2, {"input_ids": ids}), run_whole(model, {"input_ids": ids}),
                               atol=1e-5)
    np.testing.assert_allclose(run_pieces(model, 4, {"input_ids": ids}), run_whole(model, {"input_ids": ids}),
                               atol=1e-5)


def test_the_embedding_piece_sums_to_the_unsplit_gather_bit_for_bit_also_as_gathernd(model):
    import onnxruntime as ort

    names = trainable(model)
    plan = plan_tensor_parallel_split(model, names, 2)
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
    partial = []
    for rank in (0, 1):
        first = cut_pieces(shard_model(model, plan, rank), plan, model, names)[0]
        assert first.parallel and first.stage.sends == ("/Gather_1_output_0",)
        piece = deterministic_gathers(first.stage.model, set(first.stage.parameters))  # the CPU training rewrite
        assert [n.op_type for n in piece.graph.node].count("GatherND") == 1
        assert "Gather" not in {n.op_type for n in piece.graph.node if n.input and n.input[0] in names}
        session = ort.InferenceSession(piece.SerializeToString())
        partial.append(session.run(None, {"input_ids": ids})[0])
    table = weights(model)["transformer.wte.weight"]
    np.testing.assert_array_equal(partial[0] + partial[1], table[ids])
    assert not partial[0][ids >= 16].any() and not partial[1][ids < 16].any()  # zeros outside the rank's rows


def test_a_vocabulary_the_size_does_not_divide_stays_replicated_with_the_reason(tmp_path):
    gpt2_style(tmp_path / "g.onnx", vocab=13, seq_len=4, width=8, heads=2, batch=2)
    m = onnx.load(str(tmp_path / "g.onnx"))
    plan = plan_tensor_parallel_split(m, trainable(m), 2)
    assert plan.kept["transformer.wte.weight"] == (
        "vocabulary split: horizontal_parallel_size 2 does not divide the vocabulary 13")
    assert not any(r.vocab for r in plan.regions) and plan.regions  # the blocks are still split


def test_gemms_with_in_out_weights_split_columns_then_rows_and_compute_the_unsplit_logits():
    from tests.support.batch_models import fixed_batch_classifier

    raw = fixed_batch_classifier(batch=4)  # Gemm(features, fc1 [8, 16], b) -> Relu -> Gemm(., fc2 [16, 3], b), transB 0
    for t in raw.graph.initializer:  # non-zero biases: one added on every rank would show
        if t.name.endswith(".bias"):
            t.CopyFrom(numpy_helper.from_array(np.linspace(0.5, 1.0, t.dims[0], dtype=np.float32), t.name))
    m = separate_gemm_biases(raw, trainable(raw))
    plan = plan_tensor_parallel_split(m, trainable(m), 2)
    assert plan.slicing() == {"fc1.weight": (1, 1), "fc1.bias": (0, 1), "fc2.weight": (0, 1)}  # fc2.bias: whole
    assert not plan.regions[0].transposed and not plan.kept
    features = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(run_pieces(m, 2, {"features": features}), run_whole(raw, {"features": features}),
                               atol=1e-6)
