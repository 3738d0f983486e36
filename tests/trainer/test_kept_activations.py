"""Separate forward and backward engine calls (``ortflow.engine.ForwardBackward``) and a pipeline stage that keeps
its in-flight micro-batches' activations (``KeptActivations``), against the training call they replace."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ortflow.artifacts_folder import GRAD_IN_SUFFIX, read_stages_record, stage_dir
from ortflow.dataprep.loader import TrainLoader
from ortflow.engine import ForwardBackward, api
from ortflow.trainer.parallel.kept_activations import KeptActivations
from ortflow.trainer.startup import session_options
from tests.support.runs import make_text_run
from tests.trainer.exports_runs import gpt2_run


def _module(folder):
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=session_options(1, True))
    module.train()
    return state, module


def _grads(state, trainable) -> list[np.ndarray]:
    return [np.array(state.parameters[n].grad, copy=True) for n in trainable]


def _listed(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _batches(cfg, k):
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    return [loader.batch(0, i) for i in range(k)]


def test_forward_then_backward_gives_the_training_call_gradients_bitwise_on_the_gpt2_export(tmp_path):
    cfg = gpt2_run(tmp_path, "dp", distributed={"num_ranks": 1})
    state, module = _module(cfg.artifacts_dir)
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    batches = _batches(cfg, 2)
    expected_loss = sum(float(module(*(b[n] for n in module.input_names()))) for b in batches)
    expected = _grads(state, trainable)

    engine = ForwardBackward((cfg.artifacts_dir / "eval_model.onnx").read_bytes(), [n for n, _ in state.parameters],
                             trainable, [], session_options(1, True), ["CPUExecutionProvider"])
    # Asked with memory patterns, the gradient graph's session runs without: with them each forward in flight takes
    # a block of the whole graph's plan (on a GPU 16.0 GiB against 3.0 GiB for two micro-batches of a 110M GPT).
    assert not engine._session.get_session_options().enable_mem_pattern
    params = {n: engine.ortvalue(state.parameters[n].data) for n, _ in state.parameters}
    arrays = [{n: np.ascontiguousarray(v) for n, v in b.items()} for b in batches]
    flights = [engine.forward([params[n] if n in params else engine.ortvalue(a[n]) for n in engine.feed_names])
               for a in arrays]  # both micro-batches in flight before either backward
    loss = sum(float(outputs[0]) for outputs, _ in flights)
    sums = None
    for _, held in flights:
        grads = [g.numpy() for g in engine.backward(held, [np.ones((), np.float32)])]
        sums = grads if sums is None else [s + g for s, g in zip(sums, grads, strict=True)]
    assert engine.grad_names == [f"{n}_grad" for n in trainable]
    assert loss == expected_loss
    for name, mine, theirs in zip(trainable, sums, expected, strict=True):
        assert mine.tobytes() == theirs.tobytes(), name


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    return make_text_run(tmp_path_factory.mktemp("kept"), "pp2",
                         distributed={"num_ranks": 2, "pipeline_parallel_size": 2},
                         train={"batch_size": 2, "gradient_accumulation_steps": 3, "num_train_steps": 18})


def test_a_stage_keeps_its_micro_batches_and_sums_the_gradients_of_its_recomputing_training_call(two_stages):
    cfg = two_stages
    info = read_stages_record(cfg.artifacts_dir)["stages"][0]
    folder = stage_dir(cfg.artifacts_dir, 0)
    sends = tuple(info["sends"])
    batches = _batches(cfg, 3)
    state, module = _module(folder)
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    module.eval()
    shapes = [[y.shape for y in _listed(module(*(b[n] for n in module.input_names())))][: len(sends)]
              for b in batches]
    rng = np.random.default_rng(0)
    arriving = [[rng.standard_normal(s).astype(np.float32) for s in shape] for shape in shapes]
    module.train()
    for b, grads in zip(batches, arriving, strict=True):  # today's call: recompute + backward per micro-batch
        feeds = {**b, **{n + GRAD_IN_SUFFIX: g for n, g in zip(sends, grads, strict=True)}}
        module(*(feeds[n] for n in module.input_names()))
    expected = _grads(state, trainable)

    state2, _module2 = _module(folder)
    kept = KeptActivations(folder / "eval_model.onnx", state2, trainable, (), sends, session_options(1, True))
    sent = [kept.forward(b) for b in batches[:2]]  # two in flight, as stage 0 of 3 holds them in 1F1B
    assert kept.in_flight() == 2
    with pytest.raises(RuntimeError, match="still wait for their backward"):
        kept.reset()
    assert kept.backward(arriving[0]) == []  # stage 0 receives nothing: no input gradient to send back
    sent.append(kept.forward(batches[2]))
    kept.backward(arriving[1])
    kept.backward(arriving[2])
    assert kept.in_flight() == 0 and kept.most_in_flight == 2
    for name, mine, theirs in zip(trainable, _grads(state2, trainable), expected, strict=True):
        assert mine.tobytes() == theirs.tobytes(), name
    assert [y.shape for y in sent[0]] == shapes[0]

    kept.reset()  # after an update, the next micro-batch replaces the sums
    kept.forward(batches[0])
    kept.backward(arriving[0])
    module.lazy_reset_grad()
    feeds = {**batches[0], **{n + GRAD_IN_SUFFIX: g for n, g in zip(sends, arriving[0], strict=True)}}
    module(*(feeds[n] for n in module.input_names()))
    for name, mine, theirs in zip(trainable, _grads(state2, trainable), _grads(state, trainable), strict=True):
        assert mine.tobytes() == theirs.tobytes(), name


def test_the_last_stage_input_gradients_equal_those_of_the_training_call(two_stages):
    """A stage that receives tensors returns their gradients from the backward call, bitwise as the training call's
    ``.backprop`` outputs (here the last stage's forward graph, fed the loss gradient 1)."""
    cfg = two_stages
    info = read_stages_record(cfg.artifacts_dir)["stages"][1]
    folder = stage_dir(cfg.artifacts_dir, 1)
    receives = tuple(info["receives"])
    state, module = _module(folder)
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    batch = _batches(cfg, 1)[0]
    _, stage0 = _module(stage_dir(cfg.artifacts_dir, 0))
    stage0.eval()
    received = _listed(stage0(*(batch[n] for n in stage0.input_names())))
    feeds = {**batch, **dict(zip(receives, received, strict=False))}
    outputs = module(*(feeds[n] for n in module.input_names()))
    expected_back = [np.asarray(x) for x in outputs[1 : 1 + len(receives)]]

    engine = ForwardBackward((folder / "eval_model.onnx").read_bytes(), [n for n, _ in state.parameters], trainable,
                             list(receives), session_options(1, True), ["CPUExecutionProvider"])
    params = {n: engine.ortvalue(state.parameters[n].data) for n, _ in state.parameters}
    arrays = {n: np.ascontiguousarray(v) for n, v in feeds.items()}
    out, held = engine.forward([params[n] if n in params else engine.ortvalue(arrays[n]) for n in engine.feed_names])
    grads = engine.backward(held, [np.ones((), np.float32)])
    assert float(out[0]) == float(np.asarray(outputs[0]))
    for mine, theirs in zip(grads[: len(receives)], expected_back, strict=True):
        assert mine.numpy().tobytes() == theirs.tobytes()


def test_recomputed_subgraphs_change_the_graph_and_not_the_gradients(two_stages, tmp_path):
    """``distributed.recompute_subgraphs``: the engine's memory optimizer recomputes the named subgraphs' outputs in
    the backward (its ``_recompute`` nodes appear in the optimized gradient graph); the gradients keep their bits."""
    cfg = two_stages
    info = read_stages_record(cfg.artifacts_dir)["stages"][0]
    folder = stage_dir(cfg.artifacts_dir, 0)
    sends = tuple(info["sends"])
    batch = _batches(cfg, 1)[0]
    grads = {}
    for plans in ((), ("LayerNormalization+:1:-1",)):
        state, _ = _module(folder)
        trainable = sorted(n for n, p in state.parameters if p.requires_grad)
        options = session_options(1, True)
        options.optimized_model_filepath = str(tmp_path / f"gradient-graph-{len(plans)}.onnx")
        kept = KeptActivations(folder / "eval_model.onnx", state, trainable, (), sends, options, plans)
        sent = kept.forward(batch)
        kept.backward([np.ones_like(y) for y in sent])
        grads[plans] = _grads(state, trainable)
        graph = onnx.load(options.optimized_model_filepath).graph
        recomputed = [n.name for n in graph.node if n.name.endswith("_recompute")]
        assert bool(recomputed) == bool(plans), recomputed
    for plain, recomputed in zip(*grads.values(), strict=True):
        assert plain.tobytes() == recomputed.tobytes()


def test_a_stage_with_a_masked_padding_row_keeps_its_micro_batches_bitwise_as_its_masked_training_call(two_stages,
                                                                                                       tmp_path):
    """A stage whose training model masks a padding row's lookup gradient (configure's pass, here on the GPT's token
    table with its most frequent id as the padding row) keeps its activations with the same mask in its gradient
    graph: its summed gradients are the masked training call's, bitwise, and the padding row's differs from the
    unmasked one's. Rows naming no lookup of the graph are refused, naming the way out."""
    import shutil

    from ortflow.configure.training_graph import mask_padding_gradients

    cfg = two_stages
    sends = tuple(read_stages_record(cfg.artifacts_dir)["stages"][0]["sends"])
    folder = tmp_path / "stage-00"
    shutil.copytree(stage_dir(cfg.artifacts_dir, 0), folder)
    graph = onnx.load(str(folder / "eval_model.onnx")).graph
    (table,) = {n.input[0] for n in graph.node if n.op_type in ("Gather", "GatherND")
                and n.input[0] in {i.name for i in graph.input}}
    batches = _batches(cfg, 3)
    ids = np.concatenate([b["input_ids"].ravel() for b in batches])
    row = int(np.bincount(ids).argmax())
    state, module = _module(folder)
    trainable = sorted(n for n, p in state.parameters if p.requires_grad)
    module.eval()
    rng = np.random.default_rng(0)
    arriving = [[rng.standard_normal(y.shape).astype(np.float32)
                 for y in _listed(module(*(b[n] for n in module.input_names())))[: len(sends)]] for b in batches]

    def kept_sums(padding_rows):
        kept_state, _ = _module(folder)
        kept = KeptActivations(folder / "eval_model.onnx", kept_state, trainable, (), sends, session_options(1, True),
                               padding_rows=padding_rows)
        for b in batches:
            kept.forward(b)
        for grads in arriving:
            kept.backward(grads)
        return kept, dict(zip(trainable, _grads(kept_state, trainable), strict=True))

    _, unmasked = kept_sums(None)
    assert mask_padding_gradients(folder / "training_model.onnx", {table: row})
    state, module = _module(folder)  # the masked training call, recomputing its forward
    for b, grads in zip(batches, arriving, strict=True):
        feeds = {**b, **{n + GRAD_IN_SUFFIX: g for n, g in zip(sends, grads, strict=True)}}
        module(*(feeds[n] for n in module.input_names()))
    expected = dict(zip(trainable, _grads(state, trainable), strict=True))
    kept, masked = kept_sums({table: row})
    assert len(kept.masked) == 1 and f"no gradient from ids equal to {row}" in str(kept.masked)
    for name in trainable:
        assert masked[name].tobytes() == expected[name].tobytes(), name
    assert np.abs(masked[table][row] - unmasked[table][row]).max() > 1e-3
    others = np.arange(len(masked[table])) != row
    assert masked[table][others].tobytes() == unmasked[table][others].tobytes()
    with pytest.raises(RuntimeError, match="no lookup gradient of \\['not_a_table'\\].*recompute_forward: true"):
        kept_sums({"not_a_table": 0})


class _DeviceBuffers:
    """A CUDA rank's buffers as the start of a rank sees them (the calls are recorded, not made)."""

    on_device = True

    def stage_options(self, options):
        return options


def _stage_body(batch_statistics: bool = False):
    from types import SimpleNamespace

    from ortflow.artifacts_folder import BATCH_STATISTICS_INPUT

    inputs = ["input_ids", *([BATCH_STATISTICS_INPUT] if batch_statistics else [])]
    part = SimpleNamespace(prepared=lambda train: SimpleNamespace(input_names=lambda: inputs))
    return SimpleNamespace(engine_parts=lambda: [part], module=SimpleNamespace(train=lambda: None),
                           buffers=_DeviceBuffers(), folder=None, state=None, trainable=["w"])


def test_cuda_stages_keep_their_activations_unless_told_or_batchnorm_or_the_last(monkeypatch, tmp_path):
    """A CUDA stage that is not the last keeps its activations with ``recompute_forward: false`` and ``auto`` (the
    default): its buffers go with the calls (the engine then runs on the rank's stream; its calls return device
    tensors where its messages go over NCCL); ``true`` recomputes, as do a BatchNorm switched to batch statistics
    before its cut and the last stage; ``auto`` keeps on a CPU stage. A stage whose training model masks an
    embedding's padding row keeps too, its padding rows handed to the calls (their gradient graph is masked), and one
    whose training model's leading-axis sums are MatMuls hands that on (their gradient graph's sums are rewritten)."""
    from types import SimpleNamespace

    from ortflow.config.distributed import DistributedConfig
    from ortflow.trainer.parallel import build

    made = []
    monkeypatch.setattr(build, "KeptActivations", lambda *args, **kwargs: made.append(kwargs) or "kept")
    body = _stage_body()
    body.folder = tmp_path

    def config(recompute_forward, device="cuda"):
        return SimpleNamespace(distributed=DistributedConfig(recompute_forward=recompute_forward, device=device))

    middle = SimpleNamespace(last=False, receives=("h",), sends=("y",), device_pipe=None, padding_rows={},
                             sums_as_matmul=False)
    assert build.keep_activations(config(False), body, middle, 1) == "kept"
    assert made[-1]["buffers"] is body.buffers and made[-1]["host_sends"]  # messages as host arrays
    assert made[-1]["padding_rows"] == {} and made[-1]["sums_as_matmul"] is False
    summing = SimpleNamespace(**{**vars(middle), "sums_as_matmul": True})
    assert build.keep_activations(config(False), body, summing, 1) == "kept"
    assert made.pop()["sums_as_matmul"] is True
    over_nccl = SimpleNamespace(last=False, receives=("h",), sends=("y",), device_pipe=object(), padding_rows={},
                                sums_as_matmul=False)
    assert build.keep_activations(config(False), body, over_nccl, 1) == "kept"
    assert made.pop()["host_sends"] is False  # its sends leave from the GPU
    assert build.keep_activations(config("auto"), body, over_nccl, 1) == "kept"
    assert made.pop()["host_sends"] is False
    assert build.keep_activations(config(True), body, middle, 1) is None
    assert build.keep_activations(config(False), _stage_body(batch_statistics=True), middle, 1) is None
    assert build.keep_activations(config("auto"), _stage_body(batch_statistics=True), middle, 1) is None
    masking = SimpleNamespace(last=False, receives=("h",), sends=("y",), device_pipe=None, padding_rows={"emb": 0},
                              sums_as_matmul=True)
    assert build.keep_activations(config(False), body, masking, 1) == "kept"
    assert [made[-1][k] for k in ("padding_rows", "sums_as_matmul")] == [{"emb": 0}, True]  # both rewrites
    made.pop()
    assert build.keep_activations(config("auto"), body, masking, 1) == "kept"
    assert made.pop()["padding_rows"] == {"emb": 0}
    assert build.keep_activations(config(True), body, masking, 1) is None
    last = SimpleNamespace(last=True, receives=("h",), sends=(), device_pipe=None, padding_rows={},
                           sums_as_matmul=True)
    assert build.keep_activations(config(False), body, last, 1) is None
    assert build.keep_activations(config("auto"), body, last, 1) is None
    assert len(made) == 1
    body.buffers = SimpleNamespace(on_device=False, stage_options=lambda options: options)
    assert build.keep_activations(config("auto", "cpu"), body, middle, 1) == "kept"
    assert made[-1]["buffers"] is body.buffers


def test_recompute_forward_auto_keeps_on_cpu_ranks_and_on_gpus():
    """``distributed.recompute_forward`` resolved: true/false as written; ``auto`` keeps on pipeline stages and
    tensor-parallel pieces, on CPU ranks and CUDA ones (a CUDA stage's messages go over NCCL); a config that says
    nothing is ``auto``. ``ortflow validate``'s plan says which."""
    from ortflow.config.distributed import DistributedConfig

    def cfg(device, value=None, **sizes):
        written = {} if value is None else {"recompute_forward": value}
        return DistributedConfig.model_validate({"device": device, **written, **sizes})

    assert cfg("cpu").recompute_forward == "auto"
    assert [cfg(d).recomputes_forward() for d in ("cpu", "cuda")] == [False, False]
    assert [cfg(d, v).recomputes_forward() for d in ("cpu", "cuda") for v in (True, "true")] == [True] * 4
    assert [cfg(d, v).recomputes_forward() for d in ("cpu", "cuda") for v in (False, "false", "auto")] == [False] * 6
    assert cfg("cpu").activations_line() is None
    pp = {"num_ranks": 2, "pipeline_parallel_size": 2}
    assert cfg("cpu", **pp).activations_line() == (
        "activations: pipeline stages but the last run each micro-batch's forward once and keep its activations until "
        "its backward (distributed.recompute_forward auto)")
    assert cfg("cuda", **pp).activations_line() == cfg("cpu", **pp).activations_line()
    assert cfg("cuda", True, **pp).activations_line() == (
        "activations: pipeline stages but the last run the forward again in the backward call "
        "(distributed.recompute_forward true)")
    tp = {"num_ranks": 2, "horizontal_parallel_size": 2}
    pieces = cfg("cuda", **tp).activations_line()
    assert "tensor-parallel pieces but the loss's run each micro-batch's forward once" in pieces
    assert cfg("cpu", True, **tp).activations_line().endswith(
        "run the forward again in the backward call (distributed.recompute_forward true)")


def test_cuda_pieces_keep_their_activations_on_the_gpu_except_integer_senders_and_the_loss(monkeypatch, tmp_path):
    """Tensor-parallel pieces on a GPU keep their activations with their sent tensors left on the device; a piece
    that sends an integer tensor and the last stage's last piece (its training call computes the loss) recompute. A
    piece whose training model masks an embedding's padding row keeps, with this rank's padding rows (a vocabulary
    split: the rank holding the row masks its local index, the other none); one whose entry says its training model's
    leading-axis sums are MatMuls has its gradient graph's rewritten too."""
    from types import SimpleNamespace

    from ortflow.trainer.parallel import kept_activations

    made = []
    monkeypatch.setattr(kept_activations, "KeptActivations",
                        lambda *args, **kwargs: made.append((args, kwargs)) or "kept")
    state = SimpleNamespace(parameters=[("w", SimpleNamespace(requires_grad=True))])

    def piece(sends, float_sends, padding_rows=None, sums=None):
        info = {"sends": sends, "float_sends": float_sends, "float_receives": ["x"]}
        if sums is not None:
            info["sums_as_matmul"] = sums
        if padding_rows is not None:
            info["padding_rows"] = padding_rows
        return SimpleNamespace(info=info, state=state, folder=tmp_path, kept=None)

    def pieces():
        return [piece(["a"], ["a"], [{"emb": 3}, {}], True), piece(["ids", "b"], ["b"]),
                piece(["c"], ["c"], [{}, {}]), piece(["loss"], ["loss"])]

    buffers = _DeviceBuffers()
    first = pieces()
    kept_activations.keep_piece_activations(first, 0, True, None, (), buffers)
    assert [p.kept for p in first] == ["kept", None, "kept", None]
    assert [kwargs for _, kwargs in made] == [
        {"buffers": buffers, "host_sends": False, "padding_rows": rows, "sums_as_matmul": sums}
        for rows, sums in (({"emb": 3}, True), ({}, False))]
    assert made[0][0][3:5] == (("x",), ("a",))  # receives (float), sends
    made.clear()
    second = pieces()
    kept_activations.keep_piece_activations(second, 1, True, None, (), buffers)
    assert [p.kept for p in second] == ["kept", None, "kept", None]
    assert [kwargs["padding_rows"] for _, kwargs in made] == [{}, {}]
