"""The torch parameters of the committed dynamo exports (tests/fixtures/exports): each trains exactly its torch
model's parameters, under their torch names, shapes and values, or is refused with the export call that avoids it."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from safetensors.numpy import load_file

from ortflow.graph.exports.torch_params import NO_OPTIMIZE, torch_parameters
from ortflow.graph.onnx_tools import GraphError
from tests.support.exports import DYNAMO_NAMES, EXPORTS, NAMES, REFUSED_DYNAMO, export_path, family, torch_record


def _state(name: str) -> dict[str, np.ndarray]:
    fresh = "-fresh" if "-fresh" in name else ""
    return load_file(str(EXPORTS / f"{family(name)}{fresh}.safetensors"))


@pytest.mark.parametrize("name", sorted(set(DYNAMO_NAMES) - set(REFUSED_DYNAMO)))
def test_dynamo_export_trains_exactly_the_torch_parameters_with_their_values(name):
    found = torch_parameters(onnx.load(str(export_path(name))))
    record, state = torch_record(family(name)), _state(name)
    assert {k: v["shape"] for k, v in found.trained.items()} == {k: list(v) for k, v in record["parameters"].items()}
    values = {t.name: numpy_helper.to_array(t) for t in found.model.graph.initializer}
    for torch_name in record["parameters"]:  # transposes undone, merged tensors untied: torch's own values
        np.testing.assert_array_equal(values[torch_name], state[torch_name], err_msg=torch_name)
    tied = {}  # torch's name of each tied parameter -> its other names (T5's shared table has three)
    for first, other in record["tied"]:
        tied.setdefault(first, set()).add(other)
    assert {k: set(v) for k, v in found.aliases.items()} == tied
    assert not set(found.frozen) & set(found.trained)  # buffers and computed constants are never trained
    onnx.checker.check_model(found.model)


def test_rope_frequencies_are_frozen_not_trained():
    for name in ("llama-dynamo.onnx", "llama-dynamo-noopt.onnx"):
        found = torch_parameters(onnx.load(str(export_path(name))))
        buffer = "model.model.rotary_emb.inv_freq" if "noopt" in name else "expand_1"
        assert buffer in found.frozen and buffer not in found.trained, found.frozen
    assert "buffer" in found.frozen["model.model.rotary_emb.inv_freq"]


def test_merged_norm_weights_are_untied_one_per_torch_parameter():
    found = torch_parameters(onnx.load(str(export_path("llama-fresh-dynamo.onnx"))))
    assert len(found.untied) == 1 and "5 torch parameters" in found.untied[0], found.untied
    norms = [n for n, v in found.trained.items() if n.endswith("norm.weight")]
    assert len(norms) == 5 and all(found.trained[n]["how"] == "merged" for n in norms)
    readers = {n: [node.op_type for node in found.model.graph.node if n in node.input] for n in norms}
    assert all(len(r) == 1 for r in readers.values()), readers  # each norm reads its own copy


def test_pre_transposed_linear_weights_get_torch_layout_behind_a_transpose():
    found = torch_parameters(onnx.load(str(export_path("llama-dynamo.onnx"))))
    q = "model.model.layers.0.self_attn.q_proj.weight"
    assert found.trained[q]["how"] == "transposed" and found.trained[q]["from"].startswith("val_")
    reader = next(n for n in found.model.graph.node if q in n.input)
    assert reader.op_type == "Transpose"
    assert not any(t.name.startswith("val_") and len(t.dims) == 2 for t in found.model.graph.initializer)


def test_dropped_parameters_are_refused_with_the_export_call_that_keeps_them():
    with pytest.raises(GraphError) as err:
        torch_parameters(onnx.load(str(export_path("gpt2-fresh-dynamo.onnx"))))
    assert "model.transformer.h.0.attn.c_attn.bias" in str(err.value)
    assert NO_OPTIMIZE in str(err.value)


def test_recurrent_weights_computed_into_gate_order_are_refused_naming_each_layer():
    """The default optimisation computes the LSTM's and GRU's weights in the ONNX ops' gate order into new constants:
    one problem per layer, naming the module, the constants and the torch parameters left without a tensor."""
    with pytest.raises(GraphError) as err:
        torch_parameters(onnx.load(str(export_path("rnn-dynamo.onnx"))))
    message = str(err.value)
    for op, module in (("LSTM", "lstm"), ("GRU", "gru")):
        assert f"{op} '{module}' reads its weights as constants the optimiser computed in the ONNX gate" in message
        assert all(f"'{module}.{p}_l0'" in message for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    assert "merged or dropped" not in message and NO_OPTIMIZE in message


def test_parameters_folded_into_computed_constants_are_refused_naming_each():
    """Gemma's RMSNorm scales by ``1 + weight``: the default optimisation folds each sum into a constant (``add_99``)
    that no op reads as a parameter, so nothing of the norm weight would be trained; only the optimiser's
    ``folded_from`` record names it. RoPE's ``inv_freq`` buffer, folded into ``expand_1`` alike, stays frozen."""
    with pytest.raises(GraphError) as err:
        torch_parameters(onnx.load(str(export_path("gemma-dynamo.onnx"))))
    message = str(err.value)
    assert ("parameter 'model.model.layers.0.input_layernorm.weight' has no tensor in the export: the optimiser folded "
            "it into the constant 'add_99'") in message
    assert "and 1 more" in message and NO_OPTIMIZE in message  # 5 norm weights, the first 4 named
    assert "inv_freq" not in message
    found = torch_parameters(onnx.load(str(export_path("gemma-dynamo-noopt.onnx"))))  # kept under their torch names
    assert all(found.trained[f"model.model.layers.{k}.input_layernorm.weight"]["how"] == "initializer"
               for k in range(2))


def test_embedding_padding_rows_are_found_from_the_torch_op():
    """Gemma's and BERT's embeddings have torch's ``padding_idx`` 0 (their ``pad_token_id``), which the ``Gather``
    does not carry: configure names the table and the row (and masks their lookup gradient), under the name the table
    is trained by."""
    found = {name: torch_parameters(onnx.load(str(export_path(name)))).padding
             for name in ("gemma-dynamo-noopt.onnx", "bert-dynamo.onnx", "llama-dynamo-noopt.onnx")}
    assert found == {"gemma-dynamo-noopt.onnx": {"model.model.embed_tokens.weight": 0},
                     "bert-dynamo.onnx": {"model.bert.embeddings.word_embeddings.weight": 0},
                     "llama-dynamo-noopt.onnx": {}}


@pytest.mark.parametrize("name", NAMES)
def test_torchscript_exports_are_left_as_they_are(name):
    assert torch_parameters(onnx.load(str(export_path(name)), load_external_data=False)) is None


def test_a_tensor_read_as_two_parameters_without_names_to_tell_them_apart_is_refused():
    # Two Linear weights the exporter merged, both read through MatMul under aten.linear of the same fx node that
    # names both: nothing says which use is which.
    fx = "%linear : call_function[target=torch.ops.aten.linear.default](args = (%x, %p_a_weight, %p_b_weight))"
    meta = {"pkg.torch.onnx.fx_node": fx, "pkg.torch.onnx.name_scopes": "['', 'a', 'linear']"}
    nodes = [helper.make_node("MatMul", ["x", "w"], [f"y{i}"], name=f"mm{i}") for i in range(2)]
    for node in nodes:
        for key, value in meta.items():
            node.metadata_props.add(key=key, value=value)
    nodes.append(helper.make_node("Add", ["y0", "y1"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [2, 3])],
                              [helper.make_tensor_value_info("y", 1, [2, 3])],
                              [numpy_helper.from_array(np.ones((3, 3), np.float32), "w")])
    with pytest.raises(GraphError, match="optimize=False"):
        torch_parameters(helper.make_model(graph))


def _torchscript_fresh(path):
    """What torch.onnx.export(dynamo=False) writes for a fresh model: equal-valued parameters (two zero biases) merged
    into the first one's initializer, the second read through ``Identity(first) -> second's torch name``."""
    zeros, w = np.zeros(4, np.float32), np.arange(16, dtype=np.float32).reshape(4, 4) / 16
    graph = helper.make_graph(
        [helper.make_node("Identity", ["a.bias"], ["b.bias"], name="Identity_7"),
         helper.make_node("MatMul", ["x", "a.weight"], ["h"], name="/a/MatMul"),
         helper.make_node("Add", ["h", "a.bias"], ["h1"], name="/a/Add"),
         helper.make_node("Add", ["h1", "b.bias"], ["y"], name="/b/Add")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w, "a.weight"), numpy_helper.from_array(zeros, "a.bias")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_torchscript_merged_equal_parameters_are_untied_one_per_torch_name(tmp_path):
    from ortflow.graph.exports.torchscript import untie_deduplicated

    model = onnx.load(str(_torchscript_fresh(tmp_path / "m.onnx")))
    untied, lines = untie_deduplicated(model)
    values = {t.name: numpy_helper.to_array(t) for t in untied.graph.initializer}
    assert sorted(values) == ["a.bias", "a.weight", "b.bias"]
    np.testing.assert_array_equal(values["b.bias"], values["a.bias"])
    assert "Identity" not in [n.op_type for n in untied.graph.node]
    assert lines == ["'b.bias' from 'a.bias' (the TorchScript exporter merged their equal values)"]
    assert untie_deduplicated(untied) == (untied, [])  # idempotent


def _configured(tmp_path, model_path):
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure

    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(model_path), "loss": "mse"},
                            "data": {"train": [str(tmp_path / "t.npz")]},
                            "train": {"batch_size": 2, "num_train_steps": 1}})
    return configure(cfg)


def test_a_fresh_torchscript_export_trains_and_gives_back_each_merged_parameter(tmp_path):
    from ortflow.export.state_dict import export_state_dict

    result = _configured(tmp_path, _torchscript_fresh(tmp_path / "m.onnx"))
    assert sorted(result.info["trainable"]) == ["a.bias", "a.weight", "b.bias"]  # trained apart, as in torch
    out = tmp_path / "w.safetensors"
    export_state_dict(result.run_dir, out, checkpoint="initial")
    written = load_file(str(out))
    assert sorted(written) == ["a.bias", "a.weight", "b.bias"]
    np.testing.assert_array_equal(written["b.bias"], np.zeros(4, np.float32))


def test_state_dict_of_a_torchscript_run_with_folded_weights_is_refused_naming_the_fix(tmp_path):
    from ortflow.export.state_dict import export_state_dict
    from ortflow.export.verify import ExportError

    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "onnx::MatMul_7")  # a Linear weight, folded transposed
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "onnx::MatMul_7"], ["h"], name="/fc/MatMul"),
         helper.make_node("Add", ["h", "fc.bias"], ["y"], name="/fc/Add")], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        [w, numpy_helper.from_array(np.ones(4, np.float32), "fc.bias")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    result = _configured(tmp_path, tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="onnx::MatMul_7") as err:
        export_state_dict(result.run_dir, tmp_path / "w.safetensors", checkpoint="initial")
    assert "do_constant_folding=False" in str(err.value)
    assert not (tmp_path / "w.safetensors").exists()


def test_batchnorm_folded_into_the_layer_before_it_is_refused_with_the_export_call_that_keeps_it():
    # torch.onnx.export(dynamo=True) of Linear -> BatchNorm1d in eval mode: the optimiser folds the BatchNorm into the
    # Linear's Gemm, which keeps the BatchNorm's fx node (its placeholders p_bn_weight, p_bn_bias) and the Linear's
    # tensor names. Trained as exported, the model would have no BatchNorm, and fc1's values would pass as bn's.
    def fx(target, args):
        return f"%y : [num_users=1] = call_function[target={target}](args = ({args}), kwargs = {{}})"

    def node(op, inputs, output, target, args, scopes):
        made = helper.make_node(op, inputs, [output], name=f"node_{output}")
        for key, value in ((FX, fx(target, args)), (SCOPES, repr(scopes))):
            made.metadata_props.add(key=key, value=value)
        return made

    from ortflow.graph.exports.torch_params import FX_NODE as FX
    from ortflow.graph.exports.torch_params import SCOPES

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [node("Gemm", ["x", "fc1.weight", "fc1.bias"], "h", "torch.ops.aten._native_batch_norm_legit_no_training"
              ".default", "%linear, %p_bn_weight, %p_bn_bias, %b_bn_running_mean, %b_bn_running_var, 0.1, 1e-05",
              ["", "bn", "_native_batch_norm_legit_no_training"]),
         node("Gemm", ["h", "fc2.weight", "fc2.bias"], "y", "torch.ops.aten.linear.default",
              "%h, %p_fc2_weight, %p_fc2_bias", ["", "fc2", "linear_1"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
         for n, s in (("fc1.weight", (4, 3)), ("fc1.bias", (4,)), ("fc2.weight", (2, 4)), ("fc2.bias", (2,)))])
    for n in graph.node:
        n.attribute.append(helper.make_attribute("transB", 1))
    with pytest.raises(GraphError, match="BatchNorm 'bn'") as err:
        torch_parameters(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert NO_OPTIMIZE in str(err.value)


def test_torchscript_tied_names_come_from_the_module_that_reads_the_weight():
    from ortflow.graph.exports.torchscript import tied_names

    emb = numpy_helper.from_array(np.ones((6, 4), np.float32), "model.wte.weight")
    scale = numpy_helper.from_array(np.ones(4, np.float32), "model.block.norm.weight")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["model.wte.weight", "ids"], ["h"], name="/model/wte/Gather"),
         helper.make_node("Mul", ["h", "model.block.norm.weight"], ["h1"], name="/model/block/Mul"),  # a parent's read
         helper.make_node("Transpose", ["model.wte.weight"], ["wt"], name="/model/lm_head/Transpose", perm=[1, 0]),
         helper.make_node("MatMul", ["h1", "wt"], ["y"], name="/model/lm_head/MatMul")], "g",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["b"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 6])], [emb, scale])
    assert tied_names(helper.make_model(graph)) == {"model.wte.weight": ["model.lm_head.weight"]}


def test_torchscript_module_held_by_two_parents_gives_no_tied_name_of_its_first_name_under_another_scope():
    # T5: the shared embedding is also each stack's embed_tokens; TorchScript names the module 'shared' in the
    # encoder's scope too. model.encoder.shared.weight is no torch name: only the LM head's read gives one
    from ortflow.graph.exports.torchscript import tied_names

    emb = numpy_helper.from_array(np.ones((6, 4), np.float32), "model.shared.weight")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["model.shared.weight", "ids"], ["h"], name="/model/encoder/shared/Gather"),
         helper.make_node("Transpose", ["model.shared.weight"], ["wt"], name="/model/lm_head/Transpose", perm=[1, 0]),
         helper.make_node("MatMul", ["h", "wt"], ["y"], name="/model/lm_head/MatMul")], "g",
        [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["b"])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 6])], [emb])
    assert tied_names(helper.make_model(graph)) == {"model.shared.weight": ["model.lm_head.weight"]}
