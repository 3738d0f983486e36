"""A tied embedding and LM head that the export's constant folding untied is found, and configure warns about it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from tests.support.exports import export_path


def test_a_tied_table_untied_by_constant_folding_is_found_and_configure_warns(tmp_path, caplog):
    from onnx import numpy_helper

    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.graph.exports.ties import folded_tie_copies

    model = onnx.load(str(export_path("gpt2.onnx")))
    trainable = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    assert folded_tie_copies(model, trainable) == []  # the export as written: one tied table
    # What do_constant_folding=True writes: Transpose(wte) folded into a new initializer read by the LM head.
    wte = next(t for t in model.graph.initializer if t.name == "model.transformer.wte.weight")
    folded = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(wte).T), "onnx::MatMul_4096")
    model.graph.initializer.append(folded)
    head = next(n for n in model.graph.node if n.op_type == "MatMul" and n.output[0] == "logits")
    head.input[1] = folded.name
    path = tmp_path / "folded.onnx"
    onnx.save(model, str(path))
    assert folded_tie_copies(model, trainable | {folded.name}) == [("model.transformer.wte.weight", folded.name, True)]
    cfg = config_from_dict({"name": "t", "output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                            "data": {"train": str(tmp_path / "x.txt"), "format": "text", "text": {"seq_len": 8}},
                            "train": {"batch_size": 2, "num_train_steps": 2}})
    with caplog.at_level("WARNING"):
        configure(cfg)
    assert "'onnx::MatMul_4096' holds the transpose of 'model.transformer.wte.weight' (32,768 more trained values)" \
        in caplog.text and "do_constant_folding=False" in caplog.text


def test_constant_tensors_of_a_fresh_initialisation_are_not_reported_as_ties():
    """Biases of zeros and LayerNorm weights of ones, as a freshly initialised model holds them at any width, are
    equal by initialisation; a real copy among them is still found."""
    from onnx import helper, numpy_helper

    from ortflow.graph.exports.ties import folded_tie_copies

    rng = np.random.default_rng(0)
    table = rng.normal(size=(64, 32)).astype(np.float32)
    values = {"ln.weight": np.ones(2048, np.float32), "ln2.weight": np.ones(2048, np.float32),
              "q.bias": np.zeros(2048, np.float32), "k.bias": np.zeros(2048, np.float32),
              "wte": table, "head": np.ascontiguousarray(table.T)}
    inits = [numpy_helper.from_array(v, n) for n, v in values.items()]
    graph = helper.make_graph([], "g", [], [], initializer=inits)
    model = helper.make_model(graph)
    assert folded_tie_copies(model, set(values)) == [("wte", "head", True)]
