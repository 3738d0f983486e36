"""Pipeline x tensor parallelism without MPI: the rank layout, configure's per-(stage, tp rank) artifacts once, and
the refusals (a cut inside a split region, tied weights across stages, CUDA) with the names and the fix."""

from __future__ import annotations

import pytest

from ortflow.artifacts_folder import ARTIFACT_FILES, piece_dir, read_pipe_tensor_record, stage_base
from ortflow.checkpoints.tp import by_stage, tp_file
from ortflow.config import ConfigError, config_from_dict
from ortflow.configure.configure import configure
from ortflow.examples.gpt import build_gpt
from ortflow.trainer.parallel.parallel_dims import place, rank_of
from ortflow.validate import tensor_parallel_problems


def test_rank_layout_puts_tp_ranks_next_to_each_other_then_stages_then_replicas():
    world, stages, tp = 8, 2, 2  # dp 2 x pp 2 x hp 2
    places = [place(r, world, stages, tp) for r in range(world)]
    assert [(p.replica, p.stage, p.tp_rank) for p in places] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(rank_of(p.replica, p.stage, p.tp_rank, stages, tp) == r for r, p in enumerate(places))

    def groups(key):
        found: dict[int, list[int]] = {}
        for r, p in enumerate(places):
            found.setdefault(getattr(p, key), []).append(r)
        return sorted(found.values())

    assert groups("tp_color") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: one host
    assert groups("pipe_color") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # stage s rank t <-> stage s+1 rank t
    assert groups("dp_color") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # one (stage, tp slice)'s replicas
    colors = {c for p in places for c in (p.tp_color, p.pipe_color, p.dp_color)}
    assert len(colors) == 12  # 4 groups of each kind, and no colour of one kind is reused by another
    # P = 1 and H = 1 are the tensor-parallel and pipeline layouts
    pairs = [divmod(r, 2) for r in range(4)]
    assert [(place(r, 4, 1, 2).replica, place(r, 4, 1, 2).tp_rank) for r in range(4)] == pairs
    assert [(place(r, 4, 2, 1).replica, place(r, 4, 2, 1).stage) for r in range(4)] == pairs
    with pytest.raises(ValueError, match="multiple of their product"):
        place(0, 6, 2, 2)


def test_stage_tp_file_names_group_by_stage():
    names = [tp_file("params", t, 2, (s, 2)) for s in (1, 0) for t in (1, 0)]
    assert names[-1] == "params-stage00-of-02-tp00-of-02.h5"
    from pathlib import Path

    groups = by_stage(sorted(Path(n) for n in names))
    assert [[p.name for p in g] for g in groups] == [
        ["params-stage00-of-02-tp00-of-02.h5", "params-stage00-of-02-tp01-of-02.h5"],
        ["params-stage01-of-02-tp00-of-02.h5", "params-stage01-of-02-tp01-of-02.h5"]]
    assert tp_file("params", 1, 2) == "params-tp01-of-02.h5"  # tensor parallel alone: unchanged


def pp_tp_cfg(tmp_path, model_path, cuts=(), device="cpu", dp=1):
    return config_from_dict({
        "name": "t", "output_dir": str(tmp_path / "run"),
        "model": {"path": str(model_path), "pipeline_cuts": list(cuts)},
        "data": {"train": str(tmp_path / "train.parquet")},
        "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"num_ranks": 4 * dp, "horizontal_parallel_size": 2, "pipeline_parallel_size": 2,
                        "device": device, "use_nccl": device == "cuda"},
    })


def test_configure_builds_every_stage_and_tp_rank_once(tmp_path):
    path = tmp_path / "gpt.onnx"
    build_gpt(path, vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
    cfg = pp_tp_cfg(tmp_path, path)
    first = configure(cfg)
    record = read_pipe_tensor_record(cfg.artifacts_dir)
    assert record["size"] == 2 and record["num_stages"] == 2 and record["cuts"] == ["h0.resid_mlp"]
    # stage 0 starts with the vocabulary-split embedding (its sum is a piece boundary), then h0's attention and MLP,
    # each with the replicated nodes before it, and the residual add the stage ends with; stage 1 starts with the
    # replicated nodes that only read what it receives (h1's ln_1), then h1's attention and MLP and its untied LM head,
    # split by vocabulary as in the whole model though the embedding is in stage 0, and ends with the logits'
    # un-padding, replicated
    expected = [[True, True, True, False], [False, True, True, True, False]]
    for s, info in enumerate(record["stages"]):
        assert [p["parallel"] for p in info["pieces"]] == expected[s]
        for rank in (0, 1):
            for piece in range(len(expected[s])):
                assert all((piece_dir(stage_base(cfg.artifacts_dir, s), rank, piece) / f).exists()
                           for f in ARTIFACT_FILES)
    stage1 = record["stages"][1]
    assert stage1["receives"] == ["h0.resid_mlp"] and "h0.resid_mlp" in stage1["pieces"][0]["float_receives"]
    assert stage1["slicing"]["h1.mlp.fc.weight"] == [1, 1] and "h0.mlp.fc.weight" not in stage1["slicing"]
    assert stage1["slicing"]["lm_head.weight"] == [1, 1]  # [C, V]: the vocabulary is axis 1
    assert first.info["pipeline_cuts"] == ["h0.resid_mlp"]
    assert any(line.startswith("stage 1: region 1: columns ['h1.mlp.fc.weight']")
               for line in first.info["tensor_parallel_split"])
    assert "stage 1: region 2: vocabulary split of ['lm_head.weight'] (axis 1) in the LM head ['lm_head.out']; " \
           "all-reduce after ['lm_head.out.tp_vocab_padded']" in first.info["tensor_parallel_split"]
    assert not (cfg.artifacts_dir / "stages").exists() and not (cfg.artifacts_dir / "tensor").exists()
    assert configure(cfg).reused  # built once


def test_a_cut_inside_a_split_region_is_refused_with_the_region_and_the_fix(tmp_path):
    path = tmp_path / "gpt.onnx"
    build_gpt(path, vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
    cfg = pp_tp_cfg(tmp_path, path, cuts=["h0.mlp.gelu.out"])
    problems = tensor_parallel_problems(cfg)
    assert len(problems) == 1
    assert "crossed by ['h0.mlp.gelu.out']" in problems[0] and "['h0.mlp.fc.weight']" in problems[0]
    assert "cut between regions instead" in problems[0]
    with pytest.raises(ConfigError, match="inside tensor-parallel region"):
        configure(cfg)
    assert tensor_parallel_problems(pp_tp_cfg(tmp_path, path, cuts=["h0.resid_mlp"])) == []


def test_tied_weights_across_stages_are_split_alike_in_every_holding_stage(tmp_path):
    from ortflow.configure.pipeline_tensor_parallel_artifacts import plan_pipeline_tensor_parallel
    from tests.support.gpt import gpt2_style

    path = gpt2_style(tmp_path / "tied.onnx", vocab=16, seq_len=4, width=8, heads=2, batch=2)
    cfg = pp_tp_cfg(tmp_path, path)
    assert tensor_parallel_problems(cfg) == []
    plans = plan_pipeline_tensor_parallel(cfg).plans
    (table,) = plans[0].stage.shared  # the embedding (stage 0) and the LM head (stage 1) read one table
    assert [sp.stage.shared for sp in plans] == [{table: (0, 1)}, {table: (0, 1)}]
    # both stages slice it by vocabulary, alike: each tp rank's rows are summed over its pipeline group
    assert plans[0].plan.slicing()[table] == plans[1].plan.slicing()[table] == (0, 1)


def test_pp_x_hp_is_accepted_on_cpu_ranks_and_gpus(tmp_path):
    path = tmp_path / "gpt.onnx"
    cfg = pp_tp_cfg(tmp_path, path, dp=2)
    assert cfg.distributed.resolved_data_parallel_size == 2
    assert pp_tp_cfg(tmp_path, path, device="cuda").distributed.device == "cuda"


def test_a_torch_shaped_gpt_split_in_stages_and_slices_computes_the_unsplit_logits(tmp_path):
    """Every stage's pieces of every tp rank, run in one process (partial sums added in rank order, the stage's
    sends passed on), give the whole model's output: fused QKV + Split, single-output LayerNorm, Concat head
    reshapes."""
    import numpy as np
    import onnx

    from ortflow.configure.pipeline_tensor_parallel_artifacts import pieces, plan_pipeline_tensor_parallel
    from tests.support.gpt import torch_gpt
    from tests.support.tensor_sim import run_whole

    path = tmp_path / "torchgpt.onnx"
    torch_gpt(path, layers=2, width=32, heads=4, vocab=64, seq=8, batch=2)
    cfg = pp_tp_cfg(tmp_path, path)
    plans = plan_pipeline_tensor_parallel(cfg).plans
    assert len(plans) == 2 and all(sp.plan.regions for sp in plans)
    fused = {n: v for sp in plans for n, v in sp.plan.slicing().items() if "c_attn.weight" in n}
    assert sorted(fused) == ["transformer.h.0.attn.c_attn.weight", "transformer.h.1.attn.c_attn.weight"]
    assert all(v == (1, 3) for v in fused.values())  # q, k, v parts each sliced by heads
    ids = np.random.default_rng(0).integers(0, 64, (2, 8))
    model = onnx.load(str(path))
    feeds = {i.name: ids for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}}
    options = ort_options()
    env = dict(feeds)
    for sp in plans:
        ranks = [pieces(sp, r) for r in range(2)]
        for k in range(len(ranks[0])):
            outs = []
            for r in range(2):
                stage = ranks[r][k].stage
                session = ort_session(stage.model, options)
                values = session.run(list(stage.sends), {i.name: env[i.name] for i in session.get_inputs()})
                outs.append(dict(zip(stage.sends, values, strict=True)))
            partial = ranks[0][k].partial_sends
            assert all(np.array_equal(outs[0][n], outs[1][n]) for n in outs[0] if n not in partial)  # replicated
            outs[0] = {n: outs[0][n] + outs[1][n] if n in partial else outs[0][n] for n in outs[0]}
            env.update(outs[0])
    out = model.graph.output[0].name
    np.testing.assert_allclose(env[out], run_whole(model, feeds), rtol=1e-5, atol=1e-5)


def ort_options():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return options


def ort_session(model, options):
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), options)
