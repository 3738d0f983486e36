"""T5's relative position bias in the tensor-parallel split (ortflow/graph/tensor_parallel/tensor_bias.py): the
attention split by heads with each rank's columns of the bias tables, on the exports as configure reads them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from ortflow.graph.tensor_parallel.tensor_shard import shard_model
from ortflow.graph.tensor_parallel.tensor_split import plan_tensor_parallel_split
from tests.support.tensor_sim import run_pieces, run_whole, trainable

TABLE = "model.{}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def configured(tmp_path, export: str, size: int) -> tuple[onnx.ModelProto, object]:
    """The export as configure splits it (the dynamo exports rebuilt from torch's names), and its plan at ``size``."""
    from ortflow.config import config_from_dict
    from ortflow.configure.tensor_parallel_artifacts import plan_tensor_parallel
    from ortflow.configure.torch_model import torch_source
    from tests.support.exports import export_path

    cfg = config_from_dict({"name": "t", "output_dir": str(tmp_path / "run"),
                            "model": {"path": str(export_path(export))},
                            "data": {"train": str(tmp_path / "train.parquet")},
                            "train": {"batch_size": 2, "num_train_steps": 2},
                            "distributed": {"num_ranks": size, "horizontal_parallel_size": size}})
    model, plan, _, _ = plan_tensor_parallel(torch_source(cfg, tmp_path / "built")[0])
    return model, plan


def t5_feeds() -> dict[str, np.ndarray]:
    """Two rows of 7 encoder tokens (the second padded after 4) and 5 decoder tokens."""
    rng = np.random.default_rng(0)
    mask = np.array([[1] * 7, [1] * 4 + [0] * 3], np.int64)
    return {"input_ids": rng.integers(1, 512, (2, 7)) * mask, "attention_mask": mask,
            "decoder_input_ids": rng.integers(1, 512, (2, 5))}


@pytest.mark.parametrize(("export", "size"), [("t5.onnx", 2), ("t5.onnx", 4), ("t5-dynamo.onnx", 2),
                                              ("t5-dynamo-noopt.onnx", 2)])
def test_t5_attention_is_split_by_heads_with_the_bias_tables_columns_and_the_pieces_compute_the_unsplit_logits(
        tmp_path, export, size):
    """Every attention is split by heads, nothing is kept whole: each self-attention's region records its stack's
    bias table, sliced on its columns (axis 1: the heads), each cross-attention slices its zero bias plus the mask
    and keeps its heads of the keys and values.
    Rank ``r`` holds columns ``[r H/tp, (r+1) H/tp)`` of each table, its model computes each self-attention's bias
    from them (the whole bias path is not in it), and the pieces compute the unsplit logits."""
    model, plan = configured(tmp_path, export, size)
    assert plan.kept == {}
    tables = [TABLE.format(stack) for stack in ("encoder", "decoder")]
    for table in tables:
        assert plan.slicing()[table] == (1, 1)
        readers = [r for r in plan.regions if table in r.position_bias]
        assert len(readers) == 2 and all(len(r.num_heads) == 3 for r in readers)  # q, k, v of both layers
    assert len([r for r in plan.regions if r.head_slices]) == 2  # the decoder's two cross-attentions
    # whose keys and values (from the encoder's output) have the query's 4 heads: none is replicated, though the
    # decoder's earlier layers (its MLPs, 128 wide) reach its queries and not its keys
    assert not [r.replicated_kv for r in plan.regions if r.replicated_kv]
    whole = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    per = 4 // size
    for rank in range(size):
        local = shard_model(model, plan, rank)
        held = {t.name: numpy_helper.to_array(t) for t in local.graph.initializer}
        for table in tables:
            np.testing.assert_array_equal(held[table], whole[table][:, rank * per:(rank + 1) * per])
            assert sum(n.op_type == "Gather" and n.input[0] == table for n in local.graph.node) == 2  # one per layer
    feeds = t5_feeds()
    np.testing.assert_allclose(run_pieces(model, size, feeds), run_whole(model, feeds), atol=2e-6)


def test_a_bias_table_whose_bias_is_also_read_elsewhere_keeps_the_attentions_that_add_it_whole(tmp_path):
    """The encoder's bias also a model output: the table cannot be split by its columns, so both encoder
    self-attentions are kept whole, each saying why; the decoder's attentions are split as before."""
    model, _ = configured(tmp_path, "t5.onnx", 2)
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == TABLE.format("encoder"))
    model.graph.output.append(helper.make_tensor_value_info(gather.output[0], onnx.TensorProto.FLOAT, None))
    plan = plan_tensor_parallel_split(model, trainable(model), 2)
    why = (f"the relative position bias table '{TABLE.format('encoder')}' cannot be split by its heads' columns: its "
           f"bias path's '{gather.output[0]}' is a graph output")
    for layer in range(2):
        attn = f"model.encoder.block.{layer}.layer.0.SelfAttention"
        assert plan.kept[f"{attn}.q.weight"] == why and plan.kept[f"{attn}.k.weight"] == why, plan.kept
    assert not [w for w in plan.kept if ".decoder." in w], plan.kept
    assert TABLE.format("encoder") not in plan.slicing() and plan.slicing()[TABLE.format("decoder")] == (1, 1)


def test_a_size_that_does_not_divide_the_t5_heads_is_refused_naming_them_and_the_sizes_that_fit(tmp_path):
    """tp 8 on the 4 heads: refused before any engine call, naming the heads and the sizes 1, 2 and 4."""
    from ortflow.configure.artifacts import ArtifactsError

    with pytest.raises(ArtifactsError) as err:
        configured(tmp_path, "t5.onnx", 8)
    assert str(err.value).startswith("distributed.horizontal_parallel_size 8 does not divide the 4 heads of "
                                     "model.encoder.block.0.layer.0.SelfAttention.q.weight; "), err.value
    assert "use one of [1, 2, 4]" in str(err.value)
