"""``ortflow validate`` on a Llama and a Qwen2 export (grouped-query attention, RoPE), a Llama with multi-query
attention (key/value heads replicated), Phi-3's exports (fused query, key and value parts of unequal widths) and on
GPT-2's TorchScript and default dynamo exports (a fused QKV projection) and GPT-NeoX's (a fused QKV projection laid
out per head) with tensor parallelism: the split plan it prints, and the sizes it refuses."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper, numpy_helper
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.validate import validate
from tests.support.exports import export_path
from tests.support.parallel_runs import corpus


def lm_config(tmp_path: Path, export: str = "llama.onnx", **distributed) -> Path:
    raw = {"output_dir": str(tmp_path / "run"), "model": {"path": str(export_path(export))},
           "data": {"train": [str(corpus(tmp_path))], "format": "text",
                    "text": {"seq_len": 16, "input_name": "input_ids"}},
           "train": {"batch_size": 2, "num_train_steps": 2}, "distributed": distributed}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def validated_plan(tmp_path: Path, export: str, size: int = 2) -> str:
    """``ortflow validate`` of ``export`` at tp ``size``: it passes and prints a split plan; its output on one line
    (the console wraps long lines)."""
    result = CliRunner().invoke(app, ["validate", str(lm_config(tmp_path, export, num_ranks=size,
                                                                   horizontal_parallel_size=size))])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "split plan:" in text and text.rstrip().endswith("valid")
    return text


@pytest.mark.parametrize("export", ["llama.onnx", "qwen2-dynamo.onnx"])
def test_validate_prints_the_llama_attention_split_by_heads(tmp_path, export):
    """Llama's, and Qwen2's of the same shape, whose query, key and value biases are split with their heads."""
    text = validated_plan(tmp_path, export)
    for layer in range(2):
        attn = f"model.model.layers.{layer}.self_attn"
        biases = [f"{attn}.{p}_proj.bias" for p in "qkv"] if export.startswith("qwen2") else []
        assert (f"columns ['{attn}.q_proj.weight', '{attn}.k_proj.weight', '{attn}.v_proj.weight'] (+ biases "
                f"{biases}), rows ['{attn}.o_proj.weight']") in text
        assert f"{attn}.q_proj.weight 4 -> 2 per rank" in text
        assert f"{attn}.k_proj.weight 2 -> 1 per rank (key/value heads, each read by 2 query heads)" in text
        assert f"columns ['model.model.layers.{layer}.mlp.gate_proj.weight', " in text
    assert "kept replicated" not in text  # every projection of the model is split
    assert ("activations: tensor-parallel pieces but the loss's run each micro-batch's forward once and keep its "
            "activations until its backward (distributed.recompute_forward auto)") in text


@pytest.mark.parametrize("export", ["phi3.onnx", "phi3-dynamo.onnx", "phi3-dynamo-noopt.onnx"])
def test_validate_prints_the_phi3_fused_qkv_split_per_part_with_the_heads_of_each(tmp_path, export):
    """Phi-3's fused ``qkv_proj`` (4 query heads, 2 key and 2 value heads, read by Slices of widths 64, 32, 32): each
    rank keeps its block of every part; the fused ``gate_up_proj`` split in its two halves (the TorchScript export's
    chunk bounds are ``(D + 1) / 2`` of the width, a constant once configure's passes read the sequence from the
    inputs: each rank's ``(128 + 1) / 2`` is half of its columns)."""
    text = validated_plan(tmp_path, export)
    for layer in range(2):
        qkv, mlp = f"model.model.layers.{layer}.self_attn.qkv_proj.weight", f"model.model.layers.{layer}.mlp"
        assert (f"columns ['{qkv}'] (+ biases []), rows ['model.model.layers.{layer}.self_attn.o_proj.weight']"
                in text)
        assert (f"fused parts {{'{qkv}': (64, 32, 32)}}" in text and f"heads: {qkv} in 3 fused parts of widths "
                "[64, 32, 32]: 4 -> 2 per rank, 2 -> 1 per rank (key/value heads, each read by 2 query heads), "
                "2 -> 1 per rank (key/value heads, each read by 2 query heads)") in text
        assert (f"columns ['{mlp}.gate_up_proj.weight'] (+ biases []), rows ['{mlp}.down_proj.weight']" in text
                and f"fused parts {{'{mlp}.gate_up_proj.weight': 2}}" in text)
    assert "kept replicated" not in text  # every layer's attention and MLP is split
    (problem,) = validate(lm_config(tmp_path, export, num_ranks=4, horizontal_parallel_size=4))
    assert problem.startswith("distributed.horizontal_parallel_size 4 does not divide the 2 key/value heads in part 1 "
                              "of the 3 fused parts of model.model.layers.0.self_attn.qkv_proj.weight"), problem
    assert problem.endswith("use one of [1, 2] (the sizes that divide every head count and the split layers' widths)")
    assert "not those of a projection that fuses them with the query heads" in problem  # not replicated, as Llama's


@pytest.mark.parametrize("export", ["neox.onnx", "neox-dynamo.onnx", "neox-dynamo-noopt.onnx"])
def test_validate_prints_the_neox_per_head_qkv_split_by_whole_heads(tmp_path, export):
    """GPT-NeoX's ``query_key_value`` is laid out per head (viewed as [batch, seq, heads, 3 * head_dim], then split
    into the query, key and value): it is one region split by whole heads (2 of the 4 per rank, no fused parts),
    ``dense`` the rows, on every export: the dynamo exports transpose the keys as [batch * heads, seq, head_dim]
    tensors (torch's sdpa decomposition), whose merged batch and head axis the split follows. 8 ranks cannot share
    4 heads: refused, naming the sizes that fit."""
    text = validated_plan(tmp_path, export)
    for layer in range(2):
        attn, mlp = f"model.gpt_neox.layers.{layer}.attention", f"model.gpt_neox.layers.{layer}.mlp"
        assert (f"columns ['{mlp}.dense_h_to_4h.weight'] (+ biases ['{mlp}.dense_h_to_4h.bias']), rows "
                f"['{mlp}.dense_4h_to_h.weight']") in text
        assert (f"columns ['{attn}.query_key_value.weight'] (+ biases ['{attn}.query_key_value.bias']), rows "
                f"['{attn}.dense.weight']") in text
        assert f"heads: {attn}.query_key_value.weight 4 -> 2 per rank" in text
    assert "fused parts" not in text
    assert "kept replicated" not in text
    assert "vocabulary split of ['model.embed_out.weight'] (axis 0) in the LM head ['logits']" in text
    (problem,) = validate(lm_config(tmp_path, export, num_ranks=8, horizontal_parallel_size=8))
    assert problem.startswith("distributed.horizontal_parallel_size 8 does not divide the 4 heads of "
                              "model.gpt_neox.layers.0.attention.query_key_value.weight"), problem
    assert problem.endswith("use one of [1, 2, 4] (the sizes that divide every head count and the split layers' "
                            "widths)")


@pytest.mark.parametrize("export", ["llama.onnx", "llama-dynamo.onnx"])
@pytest.mark.parametrize("recompute", ["auto", True])
def test_validate_says_whether_pipeline_stages_keep_their_activations(tmp_path, recompute, export):
    config = lm_config(tmp_path, export, num_ranks=2, pipeline_parallel_size=2, recompute_forward=recompute)
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    how = ("run each micro-batch's forward once and keep its activations until its backward" if recompute == "auto"
           else "run the forward again in the backward call")
    assert f"activations: pipeline stages but the last {how} (distributed.recompute_forward {recompute})".lower() \
        in text.lower()


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"horizontal_parallel_size": 2}])
def test_validate_says_the_parts_reading_a_padding_embedding_keep_their_activations(tmp_path, layout):
    """Gemma's embedding has torch's padding_idx: the stage or piece reading it keeps its activations as the others
    do (its forward-once gradient graph is masked as its training model is), with no exception in the line."""
    config = lm_config(tmp_path, "gemma-dynamo-noopt.onnx", num_ranks=2, **layout)
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    parts = "pipeline stages but the last" if "pipeline_parallel_size" in layout else \
        "tensor-parallel pieces but the loss's"
    line = (f"activations: {parts} run each micro-batch's forward once and keep its activations until its backward "
            "(distributed.recompute_forward auto)")
    assert line in text, text
    assert "padding_idx" not in text and f"{line}, except" not in text and f"{line};" not in text, text


def replicated_kv_line(layer: int, kv_heads: int, size: int, reads: str) -> str:
    """validate's words for a layer whose key/value projections stay whole on every rank."""
    attn = f"model.model.layers.{layer}.self_attn"
    return (f"key/value heads replicated: ['{attn}.k_proj.weight', '{attn}.v_proj.weight'] whole on every rank "
            f"({kv_heads} key/value head(s), tensor-parallel size {size}; their gradients summed over the ranks): "
            + reads)


MQA_TP2_READS = "rank 0's query heads 0-1 read key/value head 0, rank 1's query heads 2-3 read key/value head 0"


@pytest.mark.parametrize("export,size,reads", [
    ("llama-mqa.onnx", 2, MQA_TP2_READS), ("llama-mqa-dynamo.onnx", 2, MQA_TP2_READS),
    ("llama.onnx", 4, "rank 0's query head 0 reads key/value head 0, rank 1's query head 1 reads key/value head 0, "
                      "rank 2's query head 2 reads key/value head 1, rank 3's query head 3 reads key/value head 1")],
    ids=["mqa-tp2", "mqa-dynamo-tp2", "gqa-tp4"])
def test_validate_prints_the_key_value_heads_replicated_where_the_size_does_not_divide_them(tmp_path, export, size,
                                                                                          reads):
    """Multi-query attention (1 key/value head, from both exporters) at tp 2, and the Llama export's 2 key/value heads
    at tp 4: the query heads are split, the key/value projections (and their RoPE) stay whole on every rank and each
    rank's query heads read the key/value heads they map to; nothing is kept replicated with a warning."""
    text = validated_plan(tmp_path, export, size)
    kv_heads = 1 if export.startswith("llama-mqa") else 2
    for layer in range(2):
        attn = f"model.model.layers.{layer}.self_attn"
        assert f"columns ['{attn}.q_proj.weight'] (+ biases []), rows ['{attn}.o_proj.weight']" in text
        assert f"heads: {attn}.q_proj.weight 4 -> {4 // size} per rank" in text
        assert replicated_kv_line(layer, kv_heads, size, reads) in text
        assert f"columns ['model.model.layers.{layer}.mlp.gate_proj.weight', " in text
    assert "kept replicated" not in text


def test_key_value_heads_whose_attention_stays_whole_are_kept_replicated_with_the_reason():
    """The multi-query export with layer 0's query projection also a graph output: that layer's attention is kept
    replicated, and its key/value projections with it, each named with why (layer 1's are read by its split
    attention)."""
    from ortflow.graph.tensor_parallel.tensor_split import describe, plan_tensor_parallel_split

    model = onnx.load(str(export_path("llama-mqa.onnx")))
    query = next(n for n in model.graph.node if n.name == "/model/model/layers.0/self_attn/q_proj/MatMul")
    model.graph.output.append(helper.make_tensor_value_info(query.output[0], onnx.TensorProto.FLOAT, None))
    trainable = [t.name for t in model.graph.initializer if t.name.endswith(".weight")]
    lines = describe(plan_tensor_parallel_split(model, trainable, 2))
    attn = "model.model.layers.{}.self_attn"
    for proj in ("k_proj", "v_proj"):
        assert (f"kept replicated: {attn.format(0)}.{proj}.weight (key/value heads (1 for 4 query heads, "
                "tensor-parallel size 2), and no split attention reads them)") in lines, lines
    assert any(line.startswith("kept replicated: " + attn.format(0) + ".q_proj.weight") for line in lines)
    assert any(replicated_kv_line(1, 1, 2, "rank 0's query heads 0-1") in line for line in lines), lines


def test_a_size_that_divides_neither_heads_nor_widths_names_a_few_heads_and_the_sizes_that_fit(tmp_path):
    (problem,) = validate(lm_config(tmp_path, num_ranks=3, horizontal_parallel_size=3))
    # 3 divides none of the 6 head counts (2 layers x q, k, v) nor any weight's width: the first three are named, the
    # rest counted, and the sizes offered divide every head count and width (no list of every sliced weight).
    assert problem.startswith("distributed.horizontal_parallel_size 3 does not divide the 4 heads of "
                              "model.model.layers.0.self_attn.q_proj.weight; the 2 key/value heads of "
                              "model.model.layers.0.self_attn.k_proj.weight; ")
    assert "; and 3 more head count(s) like them: " in problem and "layers.1" not in problem
    # 4 fits too: its key/value heads are replicated, each rank's query head reading its own
    assert problem.endswith("use one of [1, 2, 4] (the sizes that divide every head count and the split layers' "
                            "widths)"), problem


@pytest.mark.parametrize("export", ["gpt2.onnx", "gpt2-dynamo.onnx"])
def test_validate_prints_the_gpt2_split_of_every_block_with_the_heads_of_the_fused_qkv(tmp_path, export):
    """Both exporters' GPT-2 (TorchScript: ``addmm`` Gemms, the sequence from ``Shape``; dynamo: flattened products, the
    sequence clamped by ``min(n_positions, T)``, the causal mask's ``Where``): each block's attention by heads (the
    fused QKV in its 3 parts, each part's 4 heads named on the line) and MLP, and the tied table."""
    text = validated_plan(tmp_path, export)
    for block in range(4):
        h = f"model.transformer.h.{block}"
        assert (f"columns ['{h}.attn.c_attn.weight'] (+ biases ['{h}.attn.c_attn.bias']), "
                f"rows ['{h}.attn.c_proj.weight']") in text
        assert (f"fused parts {{'{h}.attn.c_attn.weight': 3, '{h}.attn.c_attn.bias': 3}}; "
                f"heads: {h}.attn.c_attn.weight 4 -> 2 per rank in each of its 3 fused parts") in text
        mlp = f"{h}.mlp"
        assert f"columns ['{mlp}.c_fc.weight'] (+ biases ['{mlp}.c_fc.bias']), rows ['{mlp}.c_proj.weight']" in text
    assert text.count("heads: ") == 4  # the attention blocks only: the MLPs have no heads
    assert "vocabulary split of ['model.transformer.wte.weight'] (axis 0) in the LM head" in text
    assert "kept replicated" not in text


@pytest.mark.parametrize("export", ["gpt2.onnx", "gpt2-dynamo.onnx"])
def test_a_size_that_does_not_divide_the_gpt2_heads_names_the_fused_qkv_weights_and_the_sizes_that_fit(tmp_path,
                                                                                                          export):
    (problem,) = validate(lm_config(tmp_path, export, num_ranks=3, horizontal_parallel_size=3))
    # 3 divides neither the 4 heads of each fused part (query, key, value) of the 4 blocks' c_attn nor any width: the
    # first three weights are named with their head count, the fourth counted; no Reshape node is named
    assert problem.startswith(
        "distributed.horizontal_parallel_size 3 does not divide the 4 heads in each of the 3 fused parts of "
        "model.transformer.h.0.attn.c_attn.weight; the 4 heads in each of the 3 fused parts of "
        "model.transformer.h.1.attn.c_attn.weight; the 4 heads in each of the 3 fused parts of "
        "model.transformer.h.2.attn.c_attn.weight; and 1 more head count(s) like them: "), problem
    assert "Reshape" not in problem
    assert problem.endswith("use one of [1, 2, 4] (the sizes that divide every head count and the split layers' "
                            "widths)"), problem


def gpt2_with_dropout(folder: Path) -> Path:
    """The GPT-2 TorchScript export with a training-mode Dropout (torch's export of ``model.train()`` writes
    ``training_mode=True``) before block 1's MLP projection."""
    model = onnx.load(str(export_path("gpt2.onnx")))
    graph = model.graph
    at = next(i for i, n in enumerate(graph.node) if "h.1/mlp/c_proj" in n.name)
    graph.initializer.extend([numpy_helper.from_array(np.array(0.1, np.float32), "drop_ratio"),
                              numpy_helper.from_array(np.array(True), "drop_training")])
    graph.node.insert(at, helper.make_node("Dropout", [graph.node[at].input[0], "drop_ratio", "drop_training"],
                                           ["dropped"], name="h1_dropout"))
    graph.node[at + 1].input[0] = "dropped"
    path = folder / "gpt2-dropout.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2, "recompute_forward": True},
                                    {"pipeline_parallel_size": 2, "recompute_forward": False},
                                    {"horizontal_parallel_size": 2, "recompute_forward": False}])
def test_a_model_with_dropout_is_refused_in_a_split_layout_whatever_recompute_forward_says(tmp_path, layout):
    """Recomputed, a stage's or piece's forward would draw other numbers in the backward call; kept, it runs its eval
    graph, where Dropout is off: refused with either value, naming the parallel size, the node and the way out."""
    config = lm_config(tmp_path, num_ranks=2, **layout)
    raw = yaml.safe_load(config.read_text())
    raw["model"]["path"] = str(gpt2_with_dropout(tmp_path))
    config.write_text(yaml.safe_dump(raw))
    size = "pipeline_parallel_size" if "pipeline_parallel_size" in layout else "horizontal_parallel_size"
    (problem,) = validate(config)
    assert problem.startswith(f"distributed.{size} 2: random operators in a split model: [\"Dropout 'h1_dropout'\"]; "
                              "with any distributed.recompute_forward"), problem
    assert "the forward runs its eval graph, where Dropout is off" in problem
    assert problem.endswith("export the model without dropout/random ops (e.g. torch eval mode), or train it with "
                            "data parallelism")
    result = CliRunner().invoke(app, ["configure", str(config)])  # as validate says, without a traceback
    assert result.exit_code == 1 and not isinstance(result.exception, ValueError), result.output
    assert "random operators in a split model" in " ".join(result.output.split())


def test_validate_prints_the_cuts_and_stage_count_of_a_pipeline_of_tensor_parallel_stages(tmp_path):
    config = lm_config(tmp_path, num_ranks=4, pipeline_parallel_size=2, horizontal_parallel_size=2)
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert re.search(r"- pipeline cuts \[.*\] \(2 stages; estimated compute per stage \d+\.\d% / \d+\.\d%, from the "
                     r"parameters each reads\) - other places to cut \(model.pipeline_cuts\), with the estimated "
                     r"compute before each: .* - stage 0: region 0:", text), text
    assert "- stage 1: region " in text
    assert ("activations: tensor-parallel pieces but the loss's run each micro-batch's forward once and keep its "
            "activations until its backward (distributed.recompute_forward auto)") in text


@pytest.mark.parametrize("export", ["gpt2.onnx", "gpt2-dynamo.onnx"])
def test_validate_prints_each_stages_estimated_compute_and_the_other_places_a_named_cut_can_take(tmp_path, export):
    """The automatic cuts balance an estimate (the parameters each stage reads): validate prints each stage's share
    and every other place to cut with the share before it, and a cut named from that list gives those shares."""
    config = lm_config(tmp_path, export, num_ranks=2, pipeline_parallel_size=2)
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    first, second = (float(x) for x in re.search(r"estimated compute per stage ([\d.]+)% / ([\d.]+)%", text).groups())
    assert abs(first + second - 100) < 0.15 and 35 < first < 65, text
    places = re.findall(r"(\S+) \(([\d.]+)%\)", text.split("other places to cut (model.pipeline_cuts), with the "
                                                               "estimated compute before each: ")[1].split(" - ")[0])
    assert len(places) >= 4, text
    shares = [float(share) for _, share in places]
    assert shares == sorted(shares) and all(0 <= x < 100 for x in shares), places
    # The place nearest a third of the compute, named: its share is the first stage's.
    name, share = min(places, key=lambda p: abs(float(p[1]) - 33))
    raw = yaml.safe_load(config.read_text())
    raw["model"]["pipeline_cuts"] = [name]
    config.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(app, ["validate", str(config)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"pipeline cuts ['{name}'] (2 stages; estimated compute per stage {share}% / " in text, text
