"""The leading-axis sums as MatMuls (ortflow/graph/gradients/leading_sums.py) in the split layouts: configure rewrites
every pipeline stage's and tensor-parallel piece's training model on ``device: cuda`` with deterministic compute, as it
does the whole model's, and records it; the forward-once gradient graph a stage or piece builds at rank start gets the
same rewrite (after the padding-row mask where both apply) and computes the same gradients. Configure runs here on the
CPU, and the rewritten graphs run on the CPU provider (the CUDA provider is not needed to check what they compute)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from ortflow.artifacts_folder import (
    piece_dir,
    read_pipe_tensor_record,
    read_stages_record,
    read_tensor_record,
    stage_base,
    stage_dir,
)
from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep.loader import TrainLoader
from ortflow.engine import ForwardBackward, api
from ortflow.graph.gradients.leading_sums import MARK, LeadingSumReport, sums_as_matmul
from ortflow.trainer.parallel.kept_activations import KeptActivations
from ortflow.trainer.startup import session_options
from tests.trainer.exports_runs import gpt2_run

GPU = {"num_ranks": 2, "device": "cuda", "use_nccl": True}
LAYOUTS = {"pp2": {"pipeline_parallel_size": 2}, "tp2": {"horizontal_parallel_size": 2},
           "pp2tp2": {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}}


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    """GPT-2 configured for 2 GPUs (default switches: the sums are rewritten), by layout."""
    root = tmp_path_factory.mktemp("sums")
    return {name: gpt2_run(root, name, distributed={**GPU, **sizes}) for name, sizes in LAYOUTS.items()}


def _training_models(artifacts_dir, layout: str) -> dict:
    """Graph key (as configure.json's ``graph_passes``) -> path of its training model."""
    if layout == "pp2":
        return {f"stage-{s:02d}": stage_dir(artifacts_dir, s) / "training_model.onnx" for s in (0, 1)}
    if layout == "tp2":
        pieces = len(read_tensor_record(artifacts_dir)["pieces"])
        return {f"rank-{r:02d}/piece-{p:02d}": piece_dir(artifacts_dir, r, p) / "training_model.onnx"
                for r in (0, 1) for p in range(pieces)}
    return {f"stage-{s['index']:02d}/rank-{r:02d}/piece-{p['index']:02d}":
            piece_dir(stage_base(artifacts_dir, s["index"]), r, p["index"]) / "training_model.onnx"
            for s in read_pipe_tensor_record(artifacts_dir)["stages"] for r in (0, 1) for p in s["pieces"]}


def _entries(artifacts_dir, layout: str) -> list[dict]:
    """The stages' or pieces' records, whose ``sums_as_matmul`` tells the ranks to rewrite their gradient graphs."""
    if layout == "pp2":
        return read_stages_record(artifacts_dir)["stages"]
    if layout == "tp2":
        return read_tensor_record(artifacts_dir)["pieces"]
    return [piece for stage in read_pipe_tensor_record(artifacts_dir)["stages"] for piece in stage["pieces"]]


def _graph(path) -> onnx.GraphProto:
    return onnx.load(str(path), load_external_data=False).graph


def _marked(path) -> int:
    """MatMuls the pass made (one per rewritten ReduceSum)."""
    return sum(n.op_type == "MatMul" and n.doc_string == MARK for n in _graph(path).node)


def _reconfigure(cfg, tmp_path, name: str, **switches):
    raw = cfg.model_dump(mode="json")
    raw["output_dir"] = str(tmp_path / name)
    raw["distributed"].update(switches)
    other = config_from_dict(raw)
    configure(other)
    return other


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_stage_and_piece_training_model_has_its_leading_sums_as_matmuls_on_gpus_unless_switched_off(
        gpu_runs, tmp_path, layout):
    """Each stage's or piece's training model holds one MatMul with ones for every ReduceSum the pass rewrites in the
    same graph built without it (``reduce_sum_as_matmul: false``), none left to rewrite; the records say so, and
    ``configure.json`` lists each graph's rewrites. With ``reduce_sum_as_matmul: false`` or ``deterministic_compute:
    false`` nothing is rewritten and the records say the ranks rewrite nothing."""
    on = gpu_runs[layout]
    off = _reconfigure(on, tmp_path, "off", reduce_sum_as_matmul=False)
    nondet = _reconfigure(on, tmp_path, "nondet", deterministic_compute=False)
    models = _training_models(on.artifacts_dir, layout)
    off_models = _training_models(off.artifacts_dir, layout)
    marked = {key: _marked(path) for key, path in models.items()}
    for key, path in models.items():
        again = LeadingSumReport()
        sums_as_matmul(onnx.load(str(path), load_external_data=False), details=again)
        assert again.rewritten == [], key  # nothing left that the pass rewrites
        plain = LeadingSumReport()
        sums_as_matmul(onnx.load(str(off_models[key]), load_external_data=False), details=plain)
        assert len(plain.rewritten) == marked[key], key
        count = {name: sum(n.op_type == "ReduceSum" for n in _graph(p).node) for name, p in
                 (("on", path), ("off", off_models[key]))}
        assert count["off"] - count["on"] == marked[key], key
    if layout == "pp2":
        assert all(n > 0 for n in marked.values()), marked
    elif layout == "tp2":  # the embeddings' pieces and the loss's piece hold no bias gradient: no sum over leading axes
        assert sorted(k for k, n in marked.items() if n) == [f"rank-{r:02d}/piece-{p:02d}" for r in (0, 1)
                                                             for p in range(2, 7)], marked
    else:  # each stage's pieces of each rank hold some
        assert {k.rsplit("/", 1)[0] for k, n in marked.items() if n} == {f"stage-{s:02d}/rank-{r:02d}" for s in (0, 1)
                                                                          for r in (0, 1)}, marked
    assert all(entry["sums_as_matmul"] is True for entry in _entries(on.artifacts_dir, layout))
    record = json.loads((on.output_dir / "configure.json").read_text())["split_graph_rewrites"]
    assert sorted(record) == sorted(k for k, n in marked.items() if n)
    for key, changes in record.items():
        (entry,) = changes
        assert entry["pass"] == "sums_as_matmul" and len(entry["changes"]) == marked[key]
    for cfg in (off, nondet):
        assert {key: _marked(p) for key, p in _training_models(cfg.artifacts_dir, layout).items()} == dict.fromkeys(
            models, 0)
        assert all(entry["sums_as_matmul"] is False for entry in _entries(cfg.artifacts_dir, layout))
        assert json.loads((cfg.output_dir / "configure.json").read_text())["split_graph_rewrites"] == {}


def _batches(cfg, k: int) -> list[dict]:
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    return [loader.batch(0, i) for i in range(k)]


def _feeds(folder, batch: dict, receives: tuple[str, ...], rng) -> dict:
    """A micro-batch's feeds of a stage's or piece's eval model: the batch's, and random values for what it receives
    (dims named as the batch's token ids take their sizes; another symbolic dim is the rows of a Gemm over the
    flattened tokens)."""
    declared = {i.name: i.type.tensor_type.shape.dim for i in _graph(folder / "eval_model.onnx").input}
    sizes = {d.dim_param: n for d, n in zip(declared["input_ids"], batch["input_ids"].shape, strict=True)}
    tokens = batch["input_ids"].size
    shapes = {name: [d.dim_value or sizes.get(d.dim_param, tokens) for d in declared[name]] for name in receives}
    return {**batch, **{name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}}


def _kept_gradients(folder, info: dict, batches: list[dict], sums: bool, padding_rows=None):
    """Gradients of 3 micro-batches through the forward-once calls (the CPU provider), with or without the sums as
    MatMuls in their gradient graph: the parameters' sums and each backward's input gradients."""
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=session_options(1, True))  # allocates the gradient buffers
    module.train()
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    receives = tuple(info.get("float_receives", info["receives"]))
    kept = KeptActivations(folder / "eval_model.onnx", state, trainable, receives, tuple(info["sends"]),
                           session_options(1, True), padding_rows=padding_rows, sums_as_matmul=sums)
    rng = np.random.default_rng(0)
    feeds = [_feeds(folder, b, receives, rng) for b in batches]
    sent = [kept.forward(f) for f in feeds]
    back = [kept.backward([rng.standard_normal(y.shape).astype(np.float32) for y in ys]) for ys in sent]
    grads = {n: np.array(state.parameters[n].grad, copy=True) for n in trainable}
    grads.update({f"{name}@{k}": g for k, gs in enumerate(back) for name, g in zip(receives, gs, strict=True)})
    return kept, grads


def _largest_difference(want: dict, got: dict) -> float:
    """The largest difference of any tensor, as a share of that tensor's largest value: float32 rounding of sums in
    another order is ~1e-7, a wrong sum (a missing row, a wrong axis) O(1)."""
    assert set(want) == set(got)
    return max(float(np.abs(got[n] - want[n]).max()) / max(float(np.abs(want[n]).max()), 1e-30) for n in want)


@pytest.mark.parametrize("layout, where", [("pp2", 0), ("tp2", 3)])
def test_the_forward_once_gradient_graph_with_the_sums_as_matmuls_gives_the_same_gradients(gpu_runs, layout, where):
    """Stage 0 of the pipeline and piece 3 (an attention block and an MLP) of tensor-parallel rank 0: the rank
    rewrites its gradient graph's leading-axis sums as its record says (``sums_as_matmul``), and the parameters'
    gradients summed over 3 micro-batches and the received tensors' gradients equal those of the engine's own
    ReduceSums to float32 rounding (measured: at most 4.3e-7 of a tensor's largest value), and are not bitwise
    equal (the rewrite reaches the session)."""
    cfg = gpu_runs[layout]
    info = _entries(cfg.artifacts_dir, layout)[where]
    folder = stage_dir(cfg.artifacts_dir, where) if layout == "pp2" else piece_dir(cfg.artifacts_dir, 0, where)
    batches = _batches(cfg, 3)
    assert info["sums_as_matmul"] is True
    kept, got = _kept_gradients(folder, info, batches, info["sums_as_matmul"])
    plain, want = _kept_gradients(folder, info, batches, False)
    assert plain.sums is None and len(kept.sums.rewritten) >= 4, kept.sums
    assert _largest_difference(want, got) < 1e-5
    assert any(not np.array_equal(want[n], got[n]) for n in want)


def test_a_stage_masking_a_padding_row_gets_both_rewrites_in_its_gradient_graph(tmp_path):
    """Gemma's dynamo export (torch's padding_idx 0, its table in stage 0) on 2 GPUs: stage 0's record names the padding
    row its training model masks and the sums as MatMuls, its training model has both rewrites, and the gradient graph
    built from it at rank start has both: the mask's lookup gradient and the MatMuls, with the gradients of the
    mask-only graph to float32 rounding on a batch holding the padding id."""
    cfg = gpt2_run(tmp_path, "gemma", export="gemma-dynamo-noopt.onnx",
                   distributed={**GPU, "pipeline_parallel_size": 2})
    info = read_stages_record(cfg.artifacts_dir)["stages"][0]
    folder = stage_dir(cfg.artifacts_dir, 0)
    assert info["padding_rows"] == {"model.model.embed_tokens.weight": 0} and info["sums_as_matmul"] is True
    assert [r["pass"] for r in info["rewrites"]] == ["mask_padding_rows", "sums_as_matmul"]
    assert _marked(folder / "training_model.onnx") == len(info["rewrites"][1]["changes"]) > 0
    batches = _batches(cfg, 3)
    for b in batches:
        b["input_ids"] = b["input_ids"].copy()
        b["input_ids"][:, -3:] = 0  # the padding id: its positions give the padding row no gradient
    kept, got = _kept_gradients(folder, info, batches, True, info["padding_rows"])
    masked_only, want = _kept_gradients(folder, info, batches, False, info["padding_rows"])
    assert len(kept.masked) == 1 and len(masked_only.masked) == 1
    assert kept.sums is not None and len(kept.sums.rewritten) > 0
    assert _largest_difference(want, got) < 1e-5


def test_a_gradient_graph_without_shapes_keeps_every_sum(gpu_runs):
    """The pass reads the shapes the engine's gradient graph declares (it declares them: stage 0 of GPT-2 has its bias
    sums rewritten above); without them onnx's inference stops at the engine's own operators, and every sum is left
    as the engine wrote it, with the reason: never a guess."""
    cfg = gpu_runs["pp2"]
    folder = stage_dir(cfg.artifacts_dir, 0)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    seen = {}

    def strip(model):
        seen["declared"] = len(model.graph.value_info)
        bare = onnx.ModelProto()
        bare.CopyFrom(model)
        del bare.graph.value_info[:]
        seen["details"] = LeadingSumReport()
        seen["out"] = sums_as_matmul(bare, details=seen["details"])
        seen["in"] = bare
        return model

    ForwardBackward((folder / "eval_model.onnx").read_bytes(), [n for n, _ in state.parameters], trainable, [],
                    session_options(1, True), ["CPUExecutionProvider"], rewrite=strip)
    details = seen["details"]
    assert seen["declared"] > 0 and details.rewritten == [] and len(details.kept) > 0
    assert all("unknown" in why for why in details.kept.values()), details.kept
    assert [n.op_type for n in seen["out"].graph.node] == [n.op_type for n in seen["in"].graph.node]
