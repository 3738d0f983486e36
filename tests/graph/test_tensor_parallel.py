"""The tensor-parallel split pass and the pieces cut, on the GPT example and a torch-export-shaped GPT-2 block."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortflow.examples.gpt import build_gpt
from ortflow.graph.tensor_parallel.tensor_pieces import cut_pieces
from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_split import TensorParallelError, plan_tensor_parallel_split, split_for_rank
from ortflow.tensor_slices import merge_slices, slice_tensor
from tests.support.gpt import gpt2_style
from tests.support.tensor_sim import run_pieces, run_whole, trainable


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "gpt.onnx"
    build_gpt(path, vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
    return onnx.load(str(path))


@pytest.fixture(scope="module")
def torchlike(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "gpt2.onnx"
    gpt2_style(path, vocab=13, seq_len=4, width=8, heads=2, batch=2)
    return onnx.load(str(path))


def test_gpt_splits_attention_by_heads_the_mlp_and_the_vocabulary(gpt, caplog):
    with caplog.at_level(logging.INFO, logger="ortflow.graph.tensor_parallel.tensor_split"):
        local, plan = split_for_rank(gpt, trainable(gpt), 2, 0)
    assert [r.columns for r in plan.regions[:4]] == [
        ["h0.attn.q.weight", "h0.attn.k.weight", "h0.attn.v.weight"], ["h0.mlp.fc.weight"],
        ["h1.attn.q.weight", "h1.attn.k.weight", "h1.attn.v.weight"], ["h1.mlp.fc.weight"]]
    assert [r.rows for r in plan.regions[:4]] == [["h0.attn.proj.weight"], ["h0.mlp.proj.weight"],
                                              ["h1.attn.proj.weight"], ["h1.mlp.proj.weight"]]
    assert plan.regions[0].biases == ["h0.attn.q.bias", "h0.attn.k.bias", "h0.attn.v.bias"]
    assert plan.regions[1].outputs == ["h0.mlp.proj.mm"]  # the all-reduce comes before the row bias (added once)
    assert [r.vocab for r in plan.regions[4:]] == [{"lm_head.weight": 1}, {"wte.weight": 0}]  # [C, V] and [V, C]
    assert "lm_head.weight" not in plan.kept and "wpe.weight" not in plan.slicing()  # positions: an Add, whole
    assert "vocabulary split of ['lm_head.weight']" in caplog.text and "region 0: columns" in caplog.text
    shapes = {t.name: list(t.dims) for t in local.graph.initializer}
    assert shapes["h0.attn.q.weight"] == [32, 16] and shapes["h0.attn.q.bias"] == [16]
    assert shapes["h0.mlp.fc.weight"] == [32, 64] and shapes["h0.mlp.proj.weight"] == [64, 32]
    assert shapes["h0.mlp.proj.bias"] == [32] and shapes["ln_f.weight"] == [32]  # replicated: whole
    assert shapes["lm_head.weight"] == [32, 32] and shapes["wte.weight"] == [32, 32]  # 64 words: 32 per rank
    head_shapes = [onnx.numpy_helper.to_array(n.attribute[0].t).tolist() for n in local.graph.node
                   if n.op_type == "Constant" and n.output[0].startswith("shape.split_heads.tp2")]
    assert head_shapes and all(s == [0, 8, 2, 8] for s in head_shapes)  # 4 heads -> 2 per rank


def test_torch_shaped_fused_qkv_is_split_per_part(torchlike):
    plan = plan_tensor_parallel_split(torchlike, trainable(torchlike), 2)
    attn = plan.regions[0]
    assert attn.columns == ["transformer.h.0.attn.c_attn.weight"]
    assert attn.groups == {"transformer.h.0.attn.c_attn.weight": 3, "transformer.h.0.attn.c_attn.bias": 3}
    assert plan.regions[1].columns == ["transformer.h.0.mlp.c_fc.weight"]
    local = shard_model(torchlike, plan, 1)
    whole = onnx.numpy_helper.to_array(next(t for t in torchlike.graph.initializer if t.name == attn.columns[0]))
    mine = onnx.numpy_helper.to_array(next(t for t in local.graph.initializer if t.name == attn.columns[0]))
    # rank 1 holds the second half of each of q, k and v (columns 4:8, 12:16, 20:24 of the 24)
    np.testing.assert_array_equal(mine, np.concatenate([whole[:, 4:8], whole[:, 12:16], whole[:, 20:24]], axis=1))


@pytest.mark.parametrize("size", [2, 4])
def test_pieces_of_the_gpt_compute_the_unsplit_logits(gpt, size):
    ids = np.random.default_rng(0).integers(0, 64, (2, 8))
    # fp32: the row-split MatMuls sum their halves in another order; 1e-5 is ~100 ulps of logits of size ~1
    np.testing.assert_allclose(run_pieces(gpt, size, {"input_ids": ids}), run_whole(gpt, {"input_ids": ids}),
                               atol=1e-5)


def test_pieces_of_the_torch_shaped_model_compute_the_unsplit_logits(torchlike):
    ids = np.random.default_rng(1).integers(0, 13, (2, 4))
    np.testing.assert_allclose(run_pieces(torchlike, 2, {"input_ids": ids}),
                               run_whole(torchlike, {"input_ids": ids}), atol=1e-5)


def test_each_replicated_level_is_folded_into_the_parallel_piece_after_it(gpt):
    names = trainable(gpt)
    plan = plan_tensor_parallel_split(gpt, names, 2)
    pieces = cut_pieces(shard_model(gpt, plan, 0), plan, gpt, names)
    # the vocabulary-split embedding first (its ids are a graph input), then each split region with the replicated
    # nodes before it (position embedding, residual adds, LayerNorms, row biases), then the loss tail alone: one piece
    # per region and the tail, where a cut at every all-reduce gives two per region
    assert len(plan.regions) == 6 and [p.parallel for p in pieces] == [True] * 6 + [False]
    assert pieces[0].stage.sends == pieces[0].partial_sends == ("wte.out",)
    assert pieces[0].stage.data_inputs == ("input_ids",) and pieces[0].replicated_parameters == ()
    first = pieces[1]  # embedding sum and ln_1, then the attention region
    assert first.stage.receives == ("wte.out",) and first.stage.sends == ("h0.attn.proj.mm", "embed.out")
    assert first.partial_sends == ("h0.attn.proj.mm",)  # "embed.out" (the residual stream) is replicated
    assert set(first.replicated_parameters) == {"wpe.weight", "h0.ln_1.weight", "h0.ln_1.bias"}
    assert "embed.out" in pieces[2].stage.receives  # the residual stream skips the attention region
    assert "h0.attn.proj.bias" in pieces[2].replicated_parameters  # a row bias is added after the sum
    assert pieces[-2].stage.sends == pieces[-2].partial_sends == ("lm_head.out.tp_vocab_padded",)
    assert set(pieces[-2].replicated_parameters) == {"h1.mlp.proj.bias", "ln_f.weight", "ln_f.bias"}
    assert pieces[-1].stage.sends == ("logits",) and pieces[-1].partial_sends == ()
    sliced = set(plan.slicing())
    for piece in pieces:
        assert not sliced & set(piece.replicated_parameters)
        assert set(piece.replicated_parameters) == set(piece.stage.parameters) - sliced if piece.parallel else \
            piece.replicated_parameters == ()


@pytest.mark.parametrize("layers", [2, 22])
def test_a_llama_is_two_pieces_per_layer(tmp_path, layers):
    """Norm + attention and residual + norm + MLP per layer, between the vocabulary-split embedding, the final norm +
    LM head and the loss tail: 47 pieces for the 22 layers of the 1.1B preset (92 when every replicated level is a
    piece of its own), each two engine sessions per rank."""
    from ortflow.configure.tensor_parallel_artifacts import export_fixes
    from tools.make_large_llama import PRESETS, write_model

    shape = dataclasses.replace(PRESETS["tiny"], layers=layers)
    write_model(tmp_path / "llama.onnx", shape, seed=0)
    model = onnx.load(str(tmp_path / "llama.onnx"))
    names = trainable(model)
    model = export_fixes(model, names)
    plan = plan_tensor_parallel_split(model, names, 2)
    pieces = cut_pieces(shard_model(model, plan, 1), plan, model, names)
    assert len(plan.regions) == 2 * layers + 2  # embedding, attention and MLP per layer, LM head
    assert len(pieces) == 2 * layers + 3 == len(plan.regions) + 1
    assert [p.parallel for p in pieces] == [True] * (2 * layers + 2) + [False]
    norms = [sorted(p.replicated_parameters) for p in pieces[1:-1]]
    assert norms == [[f"model.layers.{k}.{norm}.weight"] for k in range(layers)
                     for norm in ("input_layernorm", "post_attention_layernorm")] + [["model.norm.weight"]]
    for piece in pieces[2:-2]:  # the residual stream passes on, replicated, beside the partial sums
        assert len(piece.partial_sends) == 1 and len(piece.stage.sends) == 2


def test_a_size_that_does_not_divide_the_heads_is_refused(gpt, tmp_path):
    with pytest.raises(TensorParallelError, match=r"horizontal_parallel_size 3 does not divide .*h0.attn.q.weight"):
        plan_tensor_parallel_split(gpt, trainable(gpt), 3)
    build_gpt(tmp_path / "six.onnx", vocab_size=64, seq_len=8, d_model=48, num_layers=1, num_heads=6)
    six = onnx.load(str(tmp_path / "six.onnx"))
    with pytest.raises(TensorParallelError, match=r"does not divide the 6 heads of h0.attn.q.weight.*use one of "
                                               r"\[1, 2, 3, 6\]"):  # 48 columns divide by 4, 6 heads do not
        plan_tensor_parallel_split(six, trainable(six), 4)


def test_a_model_without_a_splittable_layer_is_refused(tmp_path):
    from tests.support.graph import layernorm_classifier

    layernorm_classifier(tmp_path / "ln.onnx")
    model = onnx.load(str(tmp_path / "ln.onnx"))
    with pytest.raises(TensorParallelError, match="found no layer to split"):
        plan_tensor_parallel_split(model, trainable(model), 2)


@pytest.mark.parametrize("axis,parts", [(1, 1), (1, 3), (0, 1), (0, [8, 2, 2]), (1, [8, 16])])
def test_slices_merge_back_to_the_whole_tensor(axis, parts):
    """Equal fused parts by their number, unequal ones by their widths (Phi-3's query, key and value rows): one
    slicing for configure's rank models, a resuming rank's checkpoint and merged checkpoints."""
    value = np.arange(12 * 24, dtype=np.float32).reshape(12, 24)
    pieces = [slice_tensor(value, axis, parts, 2, r) for r in range(2)]
    assert pieces[0].shape[axis] == value.shape[axis] // 2
    np.testing.assert_array_equal(merge_slices(pieces, axis, parts), value)
    if parts == [8, 2, 2]:  # rank 1: the second half of each part's rows
        np.testing.assert_array_equal(pieces[1], np.concatenate([value[4:8], value[9:10], value[11:12]]))


@pytest.fixture(scope="module")
def bert():
    """The Hugging Face BERT export: its Linears read ``Transpose(W)`` of ``[out, in]`` weights."""
    from ortflow.configure.tensor_parallel_artifacts import export_fixes
    from tests.support.exports import export_path

    model = onnx.load(str(export_path("bert.onnx")))
    names = trainable(model)
    return export_fixes(model, names), names


def test_a_weight_read_transposed_is_transposed_inside_its_region(bert):
    model, names = bert
    plan = plan_tensor_parallel_split(model, names, 2)
    pieces = cut_pieces(shard_model(model, plan, 1), plan, model, names)
    sliced = set(plan.slicing())
    transposed = {w for r in plan.regions for w in r.transposed}
    assert "model.bert.encoder.layer.0.attention.self.value.weight" in transposed
    assert "model.bert.encoder.layer.1.output.dense.weight" in transposed
    for piece in pieces:
        # each rank's slices are read in its parallel pieces only (their gradients are the rank's own) ...
        leaked = sliced & set(piece.stage.parameters)
        assert piece.parallel or not leaked, f"replicated piece {piece.index} holds slices {sorted(leaked)}"
        # ... and what a parallel piece receives is a replicated activation, never a transposed slice
        assert not any("Transpose" in name for name in piece.float_receives), piece.float_receives
    held = {n for p in pieces if p.parallel for n in p.stage.parameters}
    assert transposed <= held


def test_a_slice_read_outside_its_region_is_refused(bert):
    model, names = bert
    plan = plan_tensor_parallel_split(model, names, 2)
    region = plan.regions[0]
    drop = next(i for i in region.nodes if model.graph.node[i].op_type == "Transpose")
    region.nodes.remove(drop)  # as if the split left the Transpose of a sliced weight to the replicated side
    with pytest.raises(TensorParallelError, match=r"Transpose '.*query/Transpose' reads the tensor-parallel slices "
                                               r"\['model.bert.encoder.layer.0.attention.self.query.weight'\] "
                                               r"outside their split region"):
        cut_pieces(shard_model(model, plan, 0), plan, model, names)


def dynamo_shaped_mlp() -> onnx.ModelProto:
    """An MLP as torch's dynamo exporter writes GPT-2's: flattened to ``[B*T, C]`` for the products, reshaped back
    with the sequence clamped by ``min(n_positions, T)`` (here 16), and a ``Where`` whose replicated fill is expanded
    to the activation's ``Shape`` (the engine's Where gradient fix, graph/gradients/gradient_fixes.py)."""
    from tests.support.graph import OPSET, Builder

    b = Builder()
    shape = b.op("Shape", ["x"])
    batch = b.op("Slice", [shape, b.const([0]), b.const([1])])
    seq = b.op("Unsqueeze", [b.op("Min", [b.const(16), b.op("Gather", [shape, b.const(1)], axis=0)]), b.const([0])])
    flat = b.op("Reshape", ["x", b.const([-1, 8])])
    hidden = b.op("Reshape", [b.linear(flat, "fc", 8, 32), b.op("Concat", [batch, seq, b.const([32])], axis=0)])
    fill = b.op("Expand", [b.const(0.0, np.float32), b.const(np.zeros(0))])
    masked = b.op("Where", ["keep", hidden, b.op("Expand", [fill, b.op("Shape", [hidden])])])
    out = b.linear(b.op("Reshape", [b.op("Relu", [masked]), b.const([-1, 32])]), "proj", 32, 8)
    b.op("Reshape", [out, b.op("Concat", [batch, seq, b.const([8])], axis=0)])
    inputs = [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", "T", 8]),
              onnx.helper.make_tensor_value_info("keep", onnx.TensorProto.BOOL, ["B", "T", 1])]
    output = onnx.helper.make_tensor_value_info(b.nodes[-1].output[0], onnx.TensorProto.FLOAT, ["B", "T", 8])
    graph = onnx.helper.make_graph(b.nodes, "main_graph", inputs, [output], b.inits)
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])


def test_a_dynamo_shaped_mlp_is_split_and_its_pieces_compute_the_unsplit_output():
    from ortflow.graph.tensor_parallel.tensor_shapes import probe_sizes

    model = dynamo_shaped_mlp()
    assert probe_sizes(model) == (11, 13)  # the shape probes stay within the clamp, so the Reshapes keep their dims
    plan = plan_tensor_parallel_split(model, trainable(model), 2)
    assert [(r.columns, r.biases, r.rows) for r in plan.regions] == [(["fc.weight"], ["fc.bias"], ["proj.weight"])]
    assert plan.kept == {}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(2, 5, 8)).astype(np.float32), "keep": rng.random((2, 5, 1)) < 0.7}
    np.testing.assert_allclose(run_pieces(model, 2, feeds), run_whole(model, feeds), atol=1e-6)


@pytest.mark.parametrize("size", [2, 4])
def test_a_shard_without_values_is_the_shard_with_its_slices_dims_only(gpt, size):
    """Checking how the pieces are cut reads no weight: each slice is its name, type and dims, as the real slice's."""
    plan = plan_tensor_parallel_split(gpt, trainable(gpt), size)
    for rank in (0, size - 1):
        real, light = shard_model(gpt, plan, rank), shard_model(gpt, plan, rank, values=False)
        assert onnx.helper.printable_graph(light.graph) == onnx.helper.printable_graph(real.graph)
        split = set(plan.slicing())
        for a, b in zip(real.graph.initializer, light.graph.initializer, strict=True):
            assert (a.name, a.data_type, list(a.dims)) == (b.name, b.data_type, list(b.dims))
            assert (b.name in split) == (not b.raw_data and not b.float_data)  # no values for the slices only
        cut = [(p.index, p.stage.sends, p.stage.receives) for p in cut_pieces(light, plan, gpt, trainable(gpt))]
        assert cut == [(p.index, p.stage.sends, p.stage.receives) for p in cut_pieces(real, plan, gpt, trainable(gpt))]


@pytest.mark.parametrize("name", ["phi3.onnx", "phi3-dynamo-noopt.onnx"])
def test_phi3_fused_projections_are_split_per_part_of_their_own_width_and_the_pieces_compute_the_unsplit_logits(name):
    """Phi-3's one ``qkv_proj`` Linear (4 query heads, then 2 key and 2 value heads of 16 rows, read by ``Slice``s of
    unequal widths): each rank keeps its block of every part (2 query heads and the key/value head they read), the
    Slices' bounds rewritten to the local widths. Its ``gate_up_proj`` (256 rows, read as two halves: by the TorchScript
    export's ``chunk`` at ``(D + 1) / 2``, which is half of each rank's 128 columns too; by the dynamo export's
    ``SplitToSequence``, which configure's passes turn into a Split: test_validate_split_plan.py) is a region of its
    own: each rank keeps its block of the gate rows and of the up rows, ``down_proj`` the rows."""
    from tests.support.exports import export_path

    model = onnx.load(str(export_path(name)))
    plan = plan_tensor_parallel_split(model, trainable(model), 2)
    for layer in range(2):
        qkv = f"model.model.layers.{layer}.self_attn.qkv_proj.weight"
        (region,) = [r for r in plan.regions if qkv in r.columns]
        assert region.columns == [qkv] and region.rows == [f"model.model.layers.{layer}.self_attn.o_proj.weight"]
        assert region.groups[qkv] == (64, 32, 32) and region.part_heads[qkv] == (4, 2, 2)
        assert plan.slicing()[qkv] == (0, (64, 32, 32))  # [out, in]: rows
        if name == "phi3.onnx":  # the dynamo export's SplitToSequence is not a split op before configure's passes
            mlp = f"model.model.layers.{layer}.mlp"
            (region,) = [r for r in plan.regions if f"{mlp}.gate_up_proj.weight" in r.columns]
            assert region.rows == [f"{mlp}.down_proj.weight"] and region.groups[f"{mlp}.gate_up_proj.weight"] == 2
            assert plan.slicing()[f"{mlp}.gate_up_proj.weight"] == (0, 2)
    if name == "phi3.onnx":
        assert plan.kept == {}
    whole = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    qkv, gate_up = "model.model.layers.0.self_attn.qkv_proj.weight", "model.model.layers.0.mlp.gate_up_proj.weight"
    rank1 = {t.name: numpy_helper.to_array(t) for t in shard_model(model, plan, 1).graph.initializer}
    np.testing.assert_array_equal(rank1[qkv], np.concatenate([whole[qkv][32:64], whole[qkv][80:96],
                                                              whole[qkv][112:128]]))
    if name == "phi3.onnx":  # rank 1's block of the gate rows, then of the up rows
        np.testing.assert_array_equal(rank1[gate_up], np.concatenate([whole[gate_up][64:128], whole[gate_up][192:]]))
    ids = np.random.default_rng(0).integers(0, 512, (2, 7))
    np.testing.assert_allclose(run_pieces(model, 2, {"input_ids": ids}), run_whole(model, {"input_ids": ids}),
                               atol=2e-6)


def test_a_chunk_bound_of_half_the_width_plus_one_follows_only_an_even_local_width():
    """TorchScript's ``chunk(2)`` bound ``(D + 1) / 2`` (integer division) is each rank's share of the whole bound
    where the local width ``D / tp`` is even; at an odd local width it rounds up on every rank, so the projection
    stays whole. Multiples of the width (``D / 2``, ``D * 3 / 4``) follow at any size that divides it."""
    from ortflow.graph.tensor_parallel.tensor_shapes import Arithmetic

    end = Arithmetic((("Add", 1), ("Div", 2), ("Mul", 2)))
    start = Arithmetic((("Add", 1), ("Div", 2), ("Mul", 1)))
    assert [start.of(256), end.of(256), start.of(7)] == [128, 256, 4]
    assert start.follows(256, 2) and end.follows(256, 2) and start.follows(256, 4) and start.follows(12, 2)
    assert not start.follows(6, 2) and not start.follows(10, 2) and not end.follows(6, 2)
    assert start.formula() == "(D + 1) / 2" and end.formula() == "((D + 1) / 2) * 2"
    plain = Arithmetic((("Mul", 3), ("Div", 4)))
    assert plain.plain and plain.follows(8, 2) and plain.of(8) == 6


@pytest.mark.parametrize(("name", "size"), [("neox.onnx", 2), ("neox.onnx", 4), ("neox-dynamo-noopt.onnx", 2),
                                            ("neox-dynamo-noopt.onnx", 4), ("neox-dynamo.onnx", 2)])
def test_neox_fused_qkv_laid_out_per_head_is_split_by_whole_heads_and_the_pieces_compute_the_unsplit_logits(name, size):
    """GPT-NeoX's ``query_key_value`` (192 rows) is laid out per head: its output is viewed as [batch, seq, 4 heads,
    48] and each head's 48 columns are split into its query, key and value (16 each). Each rank keeps whole heads,
    each with its query, key and value together: at tp 2 rank r holds rows [96 r, 96 r + 96) (heads 2 r and 2 r + 1),
    at tp 4 rows [48 r, 48 r + 48) (head r), not a block of each third (the layout of GPT-2's ``c_attn`` and Phi-3's
    ``qkv_proj``, which would give a rank the query rows of one head and the key rows of another). RoPE on the first
    4 of each head's 16 dims, the attention and the MLP in parallel on one LayerNorm'd input. The dynamo exports
    transpose the keys as [batch * heads, seq, head_dim] tensors (torch's sdpa decomposition), then view them as
    [batch, heads, head_dim, seq] again: the split follows the heads through the merged axis (the default export as
    configure reads it, its weights named and laid out as torch's)."""
    from ortflow.graph.exports.torch_params import torch_parameters
    from tests.support.exports import export_path

    model = onnx.load(str(export_path(name)))
    if name == "neox-dynamo.onnx":
        model = torch_parameters(model).model
    plan = plan_tensor_parallel_split(model, trainable(model), size)
    whole = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for layer in range(2):
        attn = f"model.gpt_neox.layers.{layer}.attention"
        (region,) = [r for r in plan.regions if f"{attn}.query_key_value.weight" in r.columns]
        assert region.columns == [f"{attn}.query_key_value.weight"] and region.rows == [f"{attn}.dense.weight"]
        assert region.biases == [f"{attn}.query_key_value.bias"]
        assert f"{attn}.query_key_value.weight" not in region.groups  # one block of whole heads, no fused parts
        assert plan.slicing()[f"{attn}.query_key_value.weight"] == (0, 1)  # [out, in]: rows
        assert region.num_heads == {f"{attn}.query_key_value.weight": 4}  # 4 // size per rank
    assert plan.kept == {}
    heads = 4 // size
    for layer in range(2):
        attn = f"model.gpt_neox.layers.{layer}.attention"
        qkv, bias, dense = (f"{attn}.query_key_value.weight", f"{attn}.query_key_value.bias", f"{attn}.dense.weight")
        for rank in range(size):
            local = {t.name: numpy_helper.to_array(t) for t in shard_model(model, plan, rank).graph.initializer}
            mine = slice(heads * rank, heads * rank + heads)  # each head's 16 query, 16 key and 16 value rows together
            np.testing.assert_array_equal(local[qkv].reshape(heads, 48, 64), whole[qkv].reshape(4, 48, 64)[mine])
            np.testing.assert_array_equal(local[bias].reshape(heads, 48), whole[bias].reshape(4, 48)[mine])
            # [out, in]: the columns that read those heads
            np.testing.assert_array_equal(local[dense], whole[dense][:, 16 * heads * rank:16 * heads * (rank + 1)])
    ids = np.random.default_rng(0).integers(0, 512, (2, 7))
    np.testing.assert_allclose(run_pieces(model, size, {"input_ids": ids}), run_whole(model, {"input_ids": ids}),
                               atol=2e-6)


def test_the_head_axis_merged_with_the_batch_is_followed_into_one_axis_and_split_back_into_the_heads():
    """``[B, H, T, D] -> [B * H, T, D]``: the heads are the innermost factor of the merged axis (B * H / tp on each
    rank, each batch row's block of heads), kept through a Reshape that keeps it whole and split back into
    ``[B, H, ...]`` (tensor_merged.py). Merging the heads with an axis after them, merging the merged axis again or
    splitting it into other factors than the batch and the heads is refused, with the reason."""
    from ortflow.graph.tensor_parallel.tensor_merged import merged_reshape

    b, t = 10007, 10009  # the probes' dynamic sizes
    assert merged_reshape([b, 4, t, 16], [4 * b, t, 16], 1, None) == (0, 4, [])
    assert merged_reshape([b, 1, 4, t, 16], [4 * b, t, 16], 2, None) == (0, 4, [])  # an axis of size 1 between
    assert merged_reshape([4 * b, 16, t], [4 * b, 16, t], 0, 4) == (0, 4, [])
    assert merged_reshape([4 * b, 16, t], [b, 4, 16, t], 0, 4) == (1, None, [0])
    assert merged_reshape([b, t, 4, 16], [b, t, 64], 2, None) == (2, None, [])  # heads outermost: no merge
    assert "and one after it" in merged_reshape([b, 4, 16, t], [b * 64, t], 1, None)
    assert "with another axis" in merged_reshape([4 * b, t, 16], [4 * b * t, 16], 0, 4)
    assert "not into the batch and the 4 heads" in merged_reshape([4 * b, t, 16], [2 * b, 2, t, 16], 0, 4)


def test_gpt2_sdpa_dynamo_attention_is_split_by_heads_through_the_keys_merged_with_the_batch(tmp_path):
    """GPT-2 with sdpa attention, exported by dynamo with ``optimize=False`` and read as configure reads it (its
    ``c_attn`` a Gemm whose bias configure's passes take out): the sdpa decomposition transposes the keys as
    [batch * heads, seq, head_dim] tensors; the split follows the heads through that merged axis, each rank keeping its
    block of the query, key and value parts, and the pieces compute the unsplit logits."""
    from ortflow.config import config_from_dict
    from ortflow.configure.tensor_parallel_artifacts import plan_tensor_parallel
    from ortflow.configure.torch_model import torch_source
    from tests.support.exports import export_path

    cfg = config_from_dict({"name": "t", "output_dir": str(tmp_path / "run"),
                            "model": {"path": str(export_path("gpt2-sdpa-dynamo-noopt.onnx"))},
                            "data": {"train": str(tmp_path / "train.parquet")},
                            "train": {"batch_size": 2, "num_train_steps": 2},
                            "distributed": {"num_ranks": 2, "horizontal_parallel_size": 2}})
    model, plan, _, _ = plan_tensor_parallel(torch_source(cfg, tmp_path / "built")[0])
    attn = "model.transformer.h.0.attn"
    (region,) = [r for r in plan.regions if f"{attn}.c_attn.weight" in r.columns]
    assert region.rows == [f"{attn}.c_proj.weight"] and region.groups[f"{attn}.c_attn.weight"] == 3
    assert region.num_heads == {f"{attn}.c_attn.weight": 2} and plan.kept == {}
    ids = np.random.default_rng(0).integers(0, 64, (2, 7))
    np.testing.assert_allclose(run_pieces(model, 2, {"input_ids": ids}), run_whole(model, {"input_ids": ids}),
                               atol=1e-6)


def test_an_output_projection_after_an_attention_kept_whole_says_its_input_is_not_split_because_of_it():
    """GPT-NeoX with an op the split does not follow inside the attention (a Hardmax for the Softmax): the attention's
    ``query_key_value`` is kept whole with that reason, and ``dense``, whose input only that attention computes, says
    so rather than where its own activation stops (the residual add with the MLP's output)."""
    from tests.support.exports import export_path

    model = onnx.load(str(export_path("neox.onnx")))
    for node in model.graph.node:
        if node.op_type == "Softmax":
            node.op_type = "Hardmax"
    plan = plan_tensor_parallel_split(model, trainable(model), 2)
    for layer in range(2):
        attn = f"model.gpt_neox.layers.{layer}.attention"
        assert plan.kept[f"{attn}.query_key_value.weight"].startswith("Hardmax "), plan.kept
        assert plan.kept[f"{attn}.query_key_value.weight"].endswith(": not an op the split follows")
        assert plan.kept[f"{attn}.dense.weight"] == (f"its input is not split: the layer before it "
                                                     f"({attn}.query_key_value.weight) is kept whole")
        assert [f"model.gpt_neox.layers.{layer}.mlp.dense_h_to_4h.weight"] in [r.columns for r in plan.regions]
