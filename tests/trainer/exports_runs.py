"""Runs on the committed real exports (tests/fixtures/exports): the Hugging Face GPT-2 and BERT, configured and
sharded under a test folder, and their final parameters whatever the layout."""

from __future__ import annotations

from pathlib import Path

from tests.support.exports import export_path

from .parallel_runs import corpus
from .runs import make_run

SEQ = 32
# 20 updates of 2 micro-batches of 2 windows (num_train_steps counts micro-batches); an eval split of 0.05 of the
# corpus.
TRAIN = {"batch_size": 2, "num_train_steps": 40, "gradient_accumulation_steps": 2, "evaluation_period": 10,
         "display_loss_steps": 1}


def gpt2_run(root: Path, name: str, **sections):
    """A run of the Hugging Face GPT-2 export, unmodified, on ortflow's own sources (byte tokens < its vocab 512)."""
    data = {"train": [str(corpus(root))], "format": "text", "text": {"seq_len": SEQ, "input_name": "input_ids"},
            "eval_fraction": 0.05}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path("gpt2.onnx"), data=data, train=train, optimizer=optimizer,
                    **sections)



def assert_export_equals_eval_graph(cfg, exported: Path, params: dict, feeds: dict, output: str = "logits") -> None:
    """The exported model's ``output`` equals, bit for bit, the unsplit eval graph's fed with ``params`` and ``feeds``
    (the labels the eval graph also reads are zeros of the shape it declares: they do not change the output)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from ortflow.graph.gelu import decompose_gelu

    # The export writes fused GELUs back as standard ops (graph/gelu.py): compare with the eval graph written alike.
    eval_proto = decompose_gelu(onnx.load(str(cfg.artifacts_dir / "eval_model.onnx")))
    eval_proto.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    first = next(iter(feeds.values()))
    all_feeds = {}
    for value in eval_proto.graph.input:
        if value.name in params:
            all_feeds[value.name] = params[value.name]
        elif value.name in feeds:
            all_feeds[value.name] = feeds[value.name]
        elif value.name == cfg.model.label_input:
            rank = len(value.type.tensor_type.shape.dim)
            all_feeds[value.name] = np.zeros(first.shape[:rank] if rank == first.ndim else first.size, np.int64)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # fusions at ALL round differently
    reference = ort.InferenceSession(eval_proto.SerializeToString(), options).run([output], all_feeds)[0]
    got = ort.InferenceSession(str(exported), options).run([output], feeds)[0]
    np.testing.assert_array_equal(got, reference)
