"""Runs on the committed real exports (tests/fixtures/exports): the Hugging Face GPT-2, Llama, BERT and ViT and the
torch LSTM + GRU classifier, configured and sharded under a test folder, and their final parameters whatever the
layout."""

from __future__ import annotations

from pathlib import Path

from tests.support.exports import export_path
from tests.support.parallel_runs import corpus
from tests.support.runs import make_run

SEQ = 32
#: Updates of every run: a layout that computes a wrong gradient moves weights by ~lr each update, so 4 show it.
UPDATES = 4
# UPDATES updates of 2 micro-batches of 2 windows (num_train_steps counts micro-batches), an eval of 8 rows after
# updates 2 and 4 (an eval split of 0.05 of the corpus).
TRAIN = {"batch_size": 2, "num_train_steps": 2 * UPDATES, "gradient_accumulation_steps": 2, "evaluation_period": 2,
         "max_eval_rows": 8, "display_loss_steps": 1}


def gpt2_run(root: Path, name: str, export: str = "gpt2.onnx", **sections):
    """A run of a causal LM export (GPT-2 by default; any export of ``input_ids -> logits`` with vocabulary 512),
    unmodified, on the test corpus of Python source (byte tokens < its vocab 512)."""
    data = {"train": [str(corpus(root))], "format": "text", "text": {"seq_len": SEQ, "input_name": "input_ids"},
            "eval_fraction": 0.05}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path(export), data=data, train=train, optimizer=optimizer,
                    **sections)


#: The Llama fixtures: TorchScript, and the dynamo exporter's default and optimize=False files.
LLAMA_EXPORTS = ["llama.onnx", "llama-dynamo.onnx", "llama-dynamo-noopt.onnx"]


def llama_run(root: Path, name: str, export: str = "llama.onnx", **sections):
    """A run of a Hugging Face Llama export (GQA: 4 query heads, 2 key/value heads; RoPE), unmodified, on ortflow's
    own sources (byte tokens < its vocab 512)."""
    data = {"train": [str(corpus(root))], "format": "text", "text": {"seq_len": SEQ, "input_name": "input_ids"},
            "eval_fraction": 0.05}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path(export), data=data, train=train, optimizer=optimizer, **sections)


def vit_data(root: Path, num_rows: int = 160) -> Path:
    """16x16 RGB images for the ViT classifier, labelled by which quadrant is brightest (4 of its 10 labels)."""
    import numpy as np

    path = root / "vit.npz"
    if not path.exists():
        rng = np.random.default_rng(0)
        pixels = rng.normal(size=(num_rows, 3, 16, 16)).astype(np.float32)
        labels = rng.integers(0, 4, num_rows)
        for k, label in enumerate(labels):
            row, col = divmod(int(label), 2)
            pixels[k, :, row * 8:(row + 1) * 8, col * 8:(col + 1) * 8] += 1.0
        np.savez(path, pixel_values=pixels, labels=labels.astype(np.int64))
    return path


def vit_run(root: Path, name: str, export: str = "vit.onnx", **sections):
    """A run of the Hugging Face ViT classifier export (TorchScript by default), unmodified (pixel_values, 10
    labels)."""
    data = {"train": [str(vit_data(root))], "eval_fraction": 0.1}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path(export), data=data, train=train, optimizer=optimizer, **sections)


#: The LSTM + GRU classifier's vocabulary and classes (tools/export_fixtures.py, ``rnn``).
RNN_VOCAB, RNN_CLASSES = 64, 5


def rnn_data(root: Path, num_rows: int = 160, seq: int = 16) -> Path:
    """Token rows for the LSTM + GRU classifier, labelled by the sum of their tokens (its 5 classes)."""
    import numpy as np

    path = root / "rnn.npz"
    if not path.exists():
        ids = np.random.default_rng(0).integers(0, RNN_VOCAB, (num_rows, seq))
        np.savez(path, input_ids=ids.astype(np.int64), labels=(ids.sum(axis=1) % RNN_CLASSES).astype(np.int64))
    return path


def rnn_run(root: Path, name: str, export: str = "rnn.onnx", **sections):
    """A run of the torch LSTM + GRU classifier export (TorchScript by default), unmodified (input_ids, 5 classes)."""
    data = {"train": [str(rnn_data(root))], "eval_fraction": 0.1}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path(export), data=data, train=train, optimizer=optimizer, **sections)


def assert_export_equals_eval_graph(cfg, exported: Path, params: dict, feeds: dict, output: str = "logits") -> None:
    """The exported model's ``output`` equals, bit for bit, the unsplit eval graph's fed with ``params`` and ``feeds``
    (the labels the eval graph also reads are zeros of the shape it declares: they do not change the output)."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    from ortflow.graph.exports.gelu import decompose_gelu

    # The export writes fused GELUs back as standard ops (graph/exports/gelu.py): compare with the eval graph written
    # alike.
    eval_proto = decompose_gelu(onnx.load(str(cfg.artifacts_dir / "eval_model.onnx")))
    eval_proto.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    first = feeds.get("decoder_input_ids", next(iter(feeds.values())))  # an encoder-decoder's labels: the decoder's
    dims = {v.name: [d.dim_param for d in v.type.tensor_type.shape.dim] for v in eval_proto.graph.input}
    all_feeds = {}
    for value in eval_proto.graph.input:
        if value.name in params:
            all_feeds[value.name] = params[value.name]
        elif value.name in feeds:
            all_feeds[value.name] = feeds[value.name]
        elif value.name == cfg.model.label_input:  # a label per row (a classifier's), per token, or flattened tokens
            rank, per_row = len(dims[value.name]), dims[value.name][:1] == dims[next(iter(feeds))][:1] != [""]
            all_feeds[value.name] = np.zeros(first.shape[:rank] if rank == first.ndim or per_row else first.size,
                                             np.int64)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # fusions at ALL round differently
    # One thread: on two, the engine's CPU LSTM and GRU round the eval graph's and the exported model's logits apart by
    # 1.5e-8 (each deterministic; the two graphs differ only in data movement: the training graph's GatherND embedding)
    options.intra_op_num_threads = 1
    reference = ort.InferenceSession(eval_proto.SerializeToString(), options).run([output], all_feeds)[0]
    got = ort.InferenceSession(str(exported), options).run([output], feeds)[0]
    np.testing.assert_array_equal(got, reference)


def bert_data(root: Path, num_rows: int = 240, seq: int = 16) -> Path:
    """Token rows for the BERT classifier: ids, an attention mask with padding at the end of most rows, and a label
    that depends on the tokens the mask keeps."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "bert.parquet"
    if not path.exists():
        rng = np.random.default_rng(0)
        ids = rng.integers(1, 512, (num_rows, seq))
        lengths = rng.integers(seq // 2, seq + 1, num_rows)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        ids = ids * mask
        labels = (ids.sum(axis=1) // 7) % 3
        pq.write_table(pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int64())),
                                 "attention_mask": pa.array(list(mask), type=pa.list_(pa.int64())),
                                 "labels": labels}), path)
    return path


def bert_run(root: Path, name: str, export: str = "bert.onnx", **sections):
    """A run of the Hugging Face BERT classifier export (TorchScript by default), unmodified (input_ids and
    attention_mask, 3 labels)."""
    data = {"train": [str(bert_data(root))], "eval_fraction": 0.1}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path(export), data=data, train=train, optimizer=optimizer,
                    **sections)



def t5_data(root: Path, num_rows: int = 240, seq: int = 16, target: int = 12) -> Path:
    """Rows for the T5 encoder-decoder: encoder ids with an attention mask (padding at the end of most rows), the
    decoder's ids (the target shifted right after the start token 0) and a label per decoder token: the target, the
    first ``target`` tokens of the encoder's row (a copy task)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "t5.parquet"
    if not path.exists():
        rng = np.random.default_rng(0)
        lengths = rng.integers(seq // 2, seq + 1, num_rows)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        ids = rng.integers(1, 512, (num_rows, seq)) * mask
        labels = ids[:, :target]
        decoder = np.concatenate([np.zeros((num_rows, 1), np.int64), labels[:, :-1]], axis=1)
        columns = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder, "labels": labels}
        pq.write_table(pa.table({k: pa.array(list(v), type=pa.list_(pa.int64())) for k, v in columns.items()}), path)
    return path


def t5_run(root: Path, name: str, export: str = "t5.onnx", **sections):
    """A run of the Hugging Face T5 export (TorchScript by default), unmodified: input_ids, attention_mask and
    decoder_input_ids in, a label per decoder token."""
    data = {"train": [str(t5_data(root))], "eval_fraction": 0.1}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=export_path(export), data=data, train=train, optimizer=optimizer, **sections)
