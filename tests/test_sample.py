"""ortflow.sample on a tiny byte-level 'model' whose logits make each byte predict the next one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.sample import SampleError, generate

T = 8


def _next_byte_model(path, window=T):
    """input_ids int64 [1, T] -> logits [T, 256]; row of byte b peaks at b + 1 (mod 256)."""
    table = np.full((256, 256), -5.0, np.float32)
    table[np.arange(256), (np.arange(256) + 1) % 256] = 5.0
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["g"]),
         helper.make_node("Reshape", ["g", "shape"], ["logits"])],
        "next_byte",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, window])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [window, 256])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([-1, 256], np.int64), "shape")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def test_greedy_continues_from_the_last_real_position_after_left_padding(tmp_path):
    model = _next_byte_model(tmp_path / "m.onnx")
    assert generate(model, "a", max_new_tokens=5, temperature=0) == "bcdef"
    # A prompt longer than the window is cropped to its last T bytes; the next byte still follows the last one.
    assert generate(model, "xyz" * 10 + "k", max_new_tokens=3, temperature=0) == "lmn"


def test_sampling_is_repeatable_with_a_seed_and_top_k_1_is_greedy(tmp_path):
    model = _next_byte_model(tmp_path / "m.onnx")
    one = generate(model, "hello", max_new_tokens=20, temperature=5.0, top_k=None, seed=3)
    assert one == generate(model, "hello", max_new_tokens=20, temperature=5.0, top_k=None, seed=3)
    assert one != generate(model, "hello", max_new_tokens=20, temperature=5.0, top_k=None, seed=4)
    assert generate(model, "a", max_new_tokens=4, temperature=5.0, top_k=1, seed=0) == "bcde"


def test_a_model_without_token_ids_is_refused(tmp_path):
    from ortflow.examples.mlp import build_mlp

    with pytest.raises(SampleError, match="int64"):
        generate(build_mlp(tmp_path / "mlp.onnx"), "a", max_new_tokens=1)


def _fixed_batch_lm(path, batch, layout):
    """input_ids int64 [batch, T] -> next-byte logits laid out as 'btv' [batch, T, 256], 'flat' [batch*T, 256] or
    'last' [batch, 256]; row r's logits are shifted by r so that reading any row other than 0 gives other bytes."""
    table = np.full((256, 256), -5.0, np.float32)
    table[np.arange(256), (np.arange(256) + 1) % 256] = 5.0
    offsets = np.zeros((batch, 1, 256), np.float32)
    for r in range(1, batch):
        offsets[r, 0, (np.arange(256) + 1 + 7 * r) % 256] = 20.0  # row r predicts b + 1 + 7r
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["g"]), helper.make_node("Add", ["g", "off"], ["btv"])]
    inits = [numpy_helper.from_array(table, "table"), numpy_helper.from_array(offsets, "off")]
    if layout == "btv":
        out, shape = "btv", [batch, T, 256]
    elif layout == "flat":
        inits.append(numpy_helper.from_array(np.array([-1, 256], np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["btv", "shape"], ["flat"]))
        out, shape = "flat", [batch * T, 256]
    else:
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), "start"))
        inits.append(numpy_helper.from_array(np.array([T], np.int64), "end"))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis"))
        inits.append(numpy_helper.from_array(np.array([1], np.int64), "sq"))
        nodes += [helper.make_node("Slice", ["btv", "start", "end", "axis"], ["lastpos"]),
                  helper.make_node("Squeeze", ["lastpos", "sq"], ["last"])]
        out, shape = "last", [batch, 256]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, T])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("layout", ["btv", "flat", "last"])
def test_fixed_batch_above_one_is_filled_and_row_0_at_the_last_position_is_read(tmp_path, layout):
    model = _fixed_batch_lm(tmp_path / "m.onnx", batch=3, layout=layout)
    assert generate(model, "a", max_new_tokens=4, temperature=0) == "bcde"


def test_logits_of_an_unexpected_shape_are_refused_naming_the_shapes_read(tmp_path):
    table = numpy_helper.from_array(np.zeros((256, 256), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["g"]),
         helper.make_node("Transpose", ["g"], ["odd"], perm=[2, 0, 1])],
        "odd", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, T])],
        [helper.make_tensor_value_info("odd", TensorProto.FLOAT, [256, 2, T])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(tmp_path / "odd.onnx"))
    expected = r"shape \[256, 2, 8\].*reads logits shaped \[2, 8, V\], \[16, V\] or \[2, V\]"
    with pytest.raises(SampleError, match=expected):
        generate(tmp_path / "odd.onnx", "a", max_new_tokens=1)


def test_a_file_onnx_runtime_cannot_load_is_a_sample_error(tmp_path):
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(SampleError, match="ONNX Runtime cannot load"):
        generate(tmp_path / "junk.onnx", "a", max_new_tokens=1)


TOKENIZER = Path(__file__).resolve().parent / "fixtures" / "tokenizers" / "bpe-512.json"


def _next_token_model(path, vocab=512):
    """input_ids int64 [1, T] (T symbolic) -> logits [1, T, vocab]; token t predicts t + 1 (mod vocab)."""
    table = np.full((vocab, vocab), -5.0, np.float32)
    table[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 5.0
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])], "next_token",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", vocab])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def test_a_tokenizer_encodes_the_prompt_and_decodes_the_generated_ids_to_text(tmp_path):
    from ortflow.dataprep.tokenizer import open_tokenizer

    tok = open_tokenizer(TOKENIZER)
    model = _next_token_model(tmp_path / "m.onnx")
    [last] = tok.encode("def")[-1:]
    streamed = []
    text = generate(model, "def", max_new_tokens=6, temperature=0, seq_len=4, tokenizer=tok,
                    on_token=streamed.append)
    assert text == tok.decode([(last + k) % 512 for k in range(1, 7)])
    assert max(last + k for k in range(1, 7)) > 255  # ids past the bytes: decoded by the tokenizer, not as bytes
    assert b"".join(streamed).decode() == text
    # The run's window is the context when the model's token dim is symbolic and no --seq-len is given.
    assert generate(model, "def", max_new_tokens=6, temperature=0, tokenizer=tok, run_seq_len=4) == text


def test_ids_past_the_bytes_without_a_tokenizer_are_refused_naming_the_tokenizer_option(tmp_path):
    model = _next_token_model(tmp_path / "m.onnx")
    with pytest.raises(SampleError, match=r"predicts token 256, not a byte: give the tokenizer .*--tokenizer"):
        generate(model, "\xff", max_new_tokens=100, temperature=0, seq_len=4)  # UTF-8 c3 bf: 191, 192, ..., 256


def test_a_runs_export_trained_on_bytes_samples_bytes_whatever_its_vocabulary(tmp_path):
    """`ortflow sample RUN/export/model.onnx`, the command `ortflow run` prints, on a run whose text was prepared as
    bytes (no tokenizer) and whose model has more ids than bytes (a Hugging Face LM's 512): only the byte ids the run's
    data holds are sampled, where a model from elsewhere without a tokenizer is refused (the test above)."""
    from typer.testing import CliRunner

    from ortflow.cli import app
    from ortflow.config import config_from_dict, write_resolved_config

    run_dir = tmp_path / "run"
    (run_dir / "export").mkdir(parents=True)
    model = _next_token_model(run_dir / "export" / "model.onnx")
    write_resolved_config(config_from_dict({
        "name": "bytes", "output_dir": str(run_dir), "model": {"path": str(model)},
        "data": {"train": [str(tmp_path / "corpus.txt")], "format": "text", "text": {"seq_len": 4}},
        "train": {"batch_size": 2, "num_train_steps": 1}}), run_dir)
    result = CliRunner().invoke(app, ["sample", str(model), "--prompt", "\xff", "--max-new-tokens", "70",
                                      "--temperature", "0"])
    assert result.exit_code == 0, result.output
    # c3 bf: 191 predicts 192, ..., 255 (64 bytes); 255's best id, 256, is no byte: the best byte, 0, then 1 ... 5
    expected = bytes([*range(192, 256), *range(0, 6)]).decode("utf-8", errors="replace")
    assert result.output == "\xff" + expected + "\n"
