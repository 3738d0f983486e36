"""A tensor-parallel piece's received tensors whose gradients are one tensor (ortflow/graph/gradients/
same_gradients.py): configure records them from each piece's training model, the forward-once gradient graph a rank
builds finds the same, their gradients are the same bits, and the backward sums that gradient over the ranks once.
GPT-2 from both exporters (TorchScript and torch's default dynamo), configured for tp 2 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ortflow.artifacts_folder import piece_dir, read_tensor_record
from ortflow.graph.gradients.same_gradients import agreed, same_gradients
from ortflow.trainer.parallel.activations import HostTensors
from ortflow.trainer.parallel.tensor_parallel_body import TensorParallel
from tests.trainer.exports_runs import gpt2_run
from tests.trainer.test_split_leading_sums import _batches, _kept_gradients


def _graph(nodes, outputs):
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in outputs]
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("dy", TensorProto.FLOAT, [2])], value)


def test_gradients_copied_from_one_tensor_through_identities_are_the_same_and_others_are_not():
    graph = _graph([helper.make_node("Identity", ["dy"], ["a_grad"]),
                    helper.make_node("Identity", ["a_grad"], ["a.backprop"]),
                    helper.make_node("Identity", ["dy"], ["b.backprop"]),
                    helper.make_node("Neg", ["dy"], ["c.backprop"]),  # computed from it: not the same values
                    helper.make_node("Identity", ["c.backprop"], ["d.backprop"])],
                   ["a.backprop", "b.backprop", "c.backprop", "d.backprop"])
    outputs = {name: f"{name}.backprop" for name in "abcd"}
    assert same_gradients(graph, outputs) == {"b": "a", "d": "c"}  # each to the first received with that source
    flat = _graph([helper.make_node("Reshape", ["dy", "shape"], ["e.backprop"])], ["e.backprop"])
    assert same_gradients(flat, {"dy": "dy", "e": "e.backprop"}) == {"e": "dy"}  # a Reshape keeps the values' order
    assert same_gradients(graph, {"b": "b.backprop", "a": "a.backprop"}) == {"a": "b"}  # in the order received
    assert same_gradients(graph, {"c": "c.backprop"}) == {}
    looped = _graph([helper.make_node("Identity", ["y"], ["x"]), helper.make_node("Identity", ["x"], ["y"])], ["x"])
    assert isinstance(same_gradients(looped, {"x": "x", "y": "y"}), dict)  # a cycle (no valid graph) ends the walk
    assert agreed([{"b": "a", "d": "c"}, {"b": "a"}, {"b": "a", "d": "e"}]) == {"b": "a"}
    assert agreed([]) == {}


@pytest.fixture(scope="module", params=["gpt2.onnx", "gpt2-dynamo.onnx"])
def tp2(request, tmp_path_factory):
    return gpt2_run(tmp_path_factory.mktemp("same"), "tp2", export=request.param,
                    distributed={"num_ranks": 2, "horizontal_parallel_size": 2})


def test_each_blocks_residual_and_product_share_one_gradient_in_the_record_and_the_kept_graph(tp2):
    """Every piece between two row-split products receives the product's partial sum and the residual stream it is
    added to: the record names the residual's gradient as the product's; the forward-once gradient graph of rank 0's
    piece finds the same, and its two gradients are the same bits in each of 3 micro-batches."""
    pieces = read_tensor_record(tp2.artifacts_dir)["pieces"]
    shared = [p for p in pieces if p["same_gradient"]]
    assert len(shared) >= 3, [(p["index"], p["float_receives"]) for p in pieces]  # GPT-2 fixture: 2 blocks
    for p in shared:
        assert p["parallel"] and len(p["float_receives"]) == 2
        (other, first), = p["same_gradient"].items()
        assert [first, other] == p["float_receives"]  # the earlier received tensor is the one summed
    assert all(not p["same_gradient"] for p in pieces if not p["parallel"])
    info = shared[1]
    kept, grads = _kept_gradients(piece_dir(tp2.artifacts_dir, 0, info["index"]), info, _batches(tp2, 3),
                                  info["sums_as_matmul"])
    assert kept.same_input_grads == info["same_gradient"]
    (other, first), = info["same_gradient"].items()
    for k in range(3):
        assert grads[f"{other}@{k}"].tobytes() == grads[f"{first}@{k}"].tobytes()
        assert np.abs(grads[f"{first}@{k}"]).max() > 0


class _Counted:
    """tp_sum's stand-in: counts the sums and returns a copy of what it was given (one rank's part)."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, label="tensor-parallel activation sum"):
        self.calls.append(label)
        return np.array(x, copy=True) * 2


def test_the_backward_sums_a_shared_gradient_once_and_hands_both_received_tensors_its_sum():
    body = TensorParallel.__new__(TensorParallel)
    body.tp_sum, body.tensors = _Counted(), HostTensors(None, 0, 2)
    g = np.arange(4, dtype=np.float32)
    summed = body._summed(["mm", "resid", "other"], [g.reshape(2, 2), g.copy(), g + 1], {"resid": "mm"})
    assert body.tp_sum.calls == ["tensor-parallel input-gradient sum"] * 2
    assert summed[0].shape == (2, 2) and summed[1].shape == (4,)  # the shared sum in each receiver's shape
    assert summed[1].tolist() == [0, 2, 4, 6] and summed[0].reshape(-1).tolist() == [0, 2, 4, 6]
    assert summed[2].tolist() == [2, 4, 6, 8]
    assert len(body._summed(["mm", "resid"], [g, g], {})) == 2 and len(body.tp_sum.calls) == 4  # no record: one each


def test_pipeline_by_tensor_pieces_record_their_shared_gradients_too(tmp_path):
    """pp 2 x tp 2 on GPT-2: each stage's pieces between two row-split products record the product's and the
    residual's shared gradient, as the pieces of tp 2 alone do."""
    from ortflow.artifacts_folder import read_pipe_tensor_record

    cfg = gpt2_run(tmp_path, "pp2tp2", distributed={"num_ranks": 4, "pipeline_parallel_size": 2,
                                                    "horizontal_parallel_size": 2})
    stages = read_pipe_tensor_record(cfg.artifacts_dir)["stages"]
    assert len(stages) == 2
    for stage in stages:
        shared = [p for p in stage["pieces"] if p["same_gradient"]]
        assert shared, [(p["index"], p["float_receives"]) for p in stage["pieces"]]
        for p in shared:
            (other, first), = p["same_gradient"].items()
            assert p["parallel"] and {first, other} <= set(p["float_receives"])
            assert p["float_receives"].index(first) < p["float_receives"].index(other)
