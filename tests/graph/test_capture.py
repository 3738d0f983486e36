"""The training graph cut for CUDA graph capture (ortflow/graph/capture.py, configure/training_graph.py): what goes to
the tail and why, that configure writes the cut for the layouts it applies to, and that head + tail compute the
unsplit training graph's loss and gradients bit for bit on the real exports of both torch exporters (run here on the
CPU provider; the recording itself is tested on a GPU in tests/gpu/test_gpu_cuda_graphs.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from ortflow.artifacts_folder import CAPTURE_HEAD, CAPTURE_TAIL
from ortflow.config import config_from_dict
from ortflow.configure.artifacts import build_artifacts
from ortflow.configure.configure import fingerprint
from ortflow.configure.training_graph import capture_applies
from ortflow.engine import api
from ortflow.graph.capture import split_for_capture
from tests.support.exports import export_path

_ELEM = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16, "tensor(int64)": TensorProto.INT64}


def _cfg(tmp_path, model, **dist):
    return config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(model), "loss": "cross_entropy"},
        "data": {"train": [str(tmp_path / "none.npz")]}, "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"device": "cuda", "use_nccl": True, "cuda_graphs": True, **dist},
    })  # fmt: skip


def _feeds(model: onnx.ModelProto, params: dict, batch=2, seq=8) -> dict:
    """Every input of a training graph: the parameters, zeroed gradient buffers, the reset flag and a batch."""
    rng, feeds = np.random.default_rng(0), {}
    for arg in model.graph.input:
        name, dims = arg.name, arg.type.tensor_type.shape.dim
        if name in params:
            feeds[name] = params[name].copy()
        elif name.endswith("_grad.accumulation.buffer"):
            feeds[name] = np.zeros_like(params[name.removesuffix("_grad.accumulation.buffer")])
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([True])
        else:  # token ids and labels: [batch, seq], or the labels flattened
            shape = [batch, seq] if len(dims) == 2 else [batch * seq]
            feeds[name] = rng.integers(0, 500, shape).astype(np.int64)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict) -> tuple[ort.InferenceSession, dict, dict]:
    """One CPU run; returns the session, its outputs and the arrays it was fed (buffers updated in place)."""
    options = ort.SessionOptions()
    options.use_deterministic_compute = True
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fed = {a.name: feeds[a.name] for a in session.get_inputs()}
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, fed), strict=True))
    return session, outputs, fed


@pytest.mark.parametrize("export", ["gpt2.onnx", "llama-dynamo.onnx"])
def test_head_and_tail_of_a_real_export_compute_the_unsplit_loss_and_gradients_bitwise(tmp_path, export):
    cfg = _cfg(tmp_path, export_path(export))
    build_artifacts(cfg, tmp_path / "art")
    art = tmp_path / "art"
    full = onnx.load(str(art / "training_model.onnx"))
    head, tail = onnx.load(str(art / CAPTURE_HEAD)), onnx.load(str(art / CAPTURE_TAIL))
    # The embedding's gradient (GatherGrad waits for the device), what follows it and the products only it reads run
    # after the replay (GPT-2 ties its output projection to the embedding table: there the tail also computes and
    # adds the projection's share of it); the head keeps all but a few percent of the nodes.
    tail_ops = [n.op_type for n in tail.graph.node]
    assert "GatherGrad" in tail_ops and "GatherGrad" not in [n.op_type for n in head.graph.node]
    assert len(tail.graph.node) < len(full.graph.node) // 20
    if export == "gpt2.onnx":
        assert "Gemm" in tail_ops  # the projection's share, fused with the sum as in the unsplit graph
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    params = {n: np.array(p.data) for n, p in state.parameters}
    feeds = _feeds(full, params)
    _, want, want_fed = _run(full, {k: v.copy() for k, v in feeds.items()})
    head_session, got, head_fed = _run(head, feeds)
    types = {o.name: o.type for o in head_session.get_outputs()}
    for arg in tail.graph.input:  # the head's tensors the tail reads: typed as the head's session reports them
        if not arg.type.tensor_type.elem_type:
            arg.type.tensor_type.elem_type = _ELEM[types[arg.name]]
    _, tail_out, tail_fed = _run(tail, {**feeds, **got})
    loss = full.graph.output[0].name
    assert got[loss] == want[loss]
    buffers = [n for n in want_fed if n.endswith("_grad.accumulation.buffer")]
    nonzero = [n for n in buffers if np.abs(want_fed[n]).sum() > 0]  # the comparison below is not of zeros
    assert len(nonzero) >= 0.9 * len(buffers) > 0
    written = {**head_fed, **tail_fed}
    for name in buffers:
        np.testing.assert_array_equal(written[name], want_fed[name], err_msg=name)
    assert [n for n in buffers if n in tail_fed and ("emb" in n or "wte" in n)]  # the embedding's, by the tail


def test_configure_cuts_the_training_graph_only_for_a_cuda_whole_model_and_the_fingerprint_says_so(tmp_path):
    model = export_path("gpt2.onnx")
    cuda, off = _cfg(tmp_path, model), _cfg(tmp_path, model, cuda_graphs=False)
    assert fingerprint(cuda) != fingerprint(off)
    build_artifacts(off, tmp_path / "off")
    assert not (tmp_path / "off" / CAPTURE_HEAD).exists()
    cpu = config_from_dict({**cuda.model_dump(mode="json", exclude_none=True),
                            "distributed": {"device": "cpu", "cuda_graphs": True}})  # fmt: skip
    build_artifacts(cpu, tmp_path / "cpu")
    assert not (tmp_path / "cpu" / CAPTURE_HEAD).exists()
    assert capture_applies(cuda)
    for sizes in ({"pipeline_parallel_size": 2}, {"horizontal_parallel_size": 2}):  # stages and pieces: not cut
        assert not capture_applies(_cfg(tmp_path, model, num_ranks=2, **sizes))


def _graph(*nodes, inputs=("x",), outputs=("y",)):
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs]
    vo = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs]
    return helper.make_model(helper.make_graph(list(nodes), "g", vi, vo))


def test_a_graph_with_random_operators_is_not_cut_and_the_error_names_them():
    model = _graph(helper.make_node("Dropout", ["x"], ["y"], name="drop"))
    with pytest.raises(ValueError, match="random operators cannot be replayed from a CUDA graph: Dropout 'drop'"):
        split_for_capture(model)


def test_a_graph_every_node_of_which_can_be_recorded_has_no_tail():
    model = _graph(helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["y"]))
    split = split_for_capture(model)
    assert split.tail is None and split.boundary == () and split.head is model


def test_the_tail_copies_shape_computations_and_reads_device_tensors_across_the_cut():
    # y = GatherGrad(Shape(w), ids, r) + n with r = Relu(x), n = Neg(r) also a graph output: the Shape is copied into
    # the tail (a replay does not run the head's host nodes), r and n cross the cut as head outputs (the head reads r
    # too, and n is an output of its own), x and ids stay graph inputs.
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["n"]),
             helper.make_node("Shape", ["w"], ["s"]),
             helper.make_node("GatherGrad", ["s", "ids", "r"], ["g"], domain="com.microsoft"),
             helper.make_node("Add", ["g", "n"], ["y"])]  # fmt: skip
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                     helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 3]),
                     helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("n", TensorProto.FLOAT, None)]))  # fmt: skip
    split = split_for_capture(model)
    assert [n.op_type for n in split.head.graph.node] == ["Relu", "Neg"]
    assert [n.op_type for n in split.tail.graph.node] == ["Shape", "GatherGrad", "Add"]
    assert split.boundary == ("r", "n")
    assert [o.name for o in split.head.graph.output] == ["n", "r"]
    assert [i.name for i in split.tail.graph.input] == ["w", "ids", "r", "n"]
    assert [o.name for o in split.tail.graph.output] == ["y"]


def test_a_product_only_the_tail_reads_runs_in_the_tail_where_the_engine_fuses_it_with_the_sum(tmp_path):
    # A tied embedding's gradient: the output projection's share m = Gemm(a, b) plus the GatherGrad share. The engine
    # folds the Sum into the Gemm (one rounding); cut between them, the head would round m and the tail the sum.
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Gemm", ["a", "b"], ["m"], transA=1),
             helper.make_node("Shape", ["w"], ["s"]),
             helper.make_node("GatherGrad", ["s", "ids", "x"], ["g"], domain="com.microsoft"),
             helper.make_node("Sum", ["m", "g"], ["y"])]  # fmt: skip
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                     helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3]),
                     helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 3]),
                     helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
        value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 3]) for n in "mg"]),  # as exports say
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])  # fmt: skip
    split = split_for_capture(model)
    assert [n.op_type for n in split.head.graph.node] == ["Relu"]  # its result is a graph output: it stays
    assert [n.op_type for n in split.tail.graph.node] == ["Gemm", "Shape", "GatherGrad", "Sum"]
    assert split.boundary == ("a",)
    optimized = tmp_path / "tail.onnx"
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(optimized)
    tail = split.tail
    for arg in tail.graph.input:  # "a": typed as the head's session reports it
        arg.type.tensor_type.elem_type = arg.type.tensor_type.elem_type or TensorProto.FLOAT
    ort.InferenceSession(tail.SerializeToString(), options, providers=["CPUExecutionProvider"])
    fused = [n for n in onnx.load(str(optimized)).graph.node if n.op_type in ("Gemm", "Sum")]
    assert [(n.op_type, len(n.input)) for n in fused] == [("Gemm", 3)]  # Sum folded into the Gemm, as unsplit
