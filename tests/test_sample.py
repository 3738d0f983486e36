"""ortflow.sample on a tiny byte-level 'model' whose logits make each byte predict the next one."""

from __future__ import annotations

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
