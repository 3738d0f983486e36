"""Pipeline and tensor parallelism, ZeRO-1 and Adasum on the real GPT-2 (and the fresh 1-layer GPT-2 with sdpa
attention), BERT, ViT and LSTM + GRU exports (tests/fixtures/exports), trained unmodified under mpiexec: each layout
ends where the unsplit run on the same global batch ends (one unsplit run per export, the ``export_dp`` fixture), and
tensor pieces compute the unsplit model's gradients. The Llama exports' layouts are test_llama_parallel_mpi.py's;
what both files assert is tests/trainer/exports_checks.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from tests.trainer.exports_checks import (
    ATOL,
    TP_ATOL,
    assert_dynamo_layout_trains_to_the_unsplit_parameters,
    assert_equal_to,
    assert_exports_one_model,
    assert_trains_as_its_torchscript_twin,
    assert_trains_its_torch_parameters_at_dp2,
    assert_trains_with_zero1_and_adasum,
    split_lines,
    start_layouts,
)
from tests.trainer.exports_runs import SEQ, bert_data

pytestmark = pytest.mark.mpi

GPT2 = pytest.mark.parametrize("export_dp", ["gpt2.onnx"], indirect=True)


# Where the tests cut GPT-2 into two stages by hand: between blocks 1 and 2 (the automatic cut is inside block 2).
BLOCKS_1_2 = "/model/transformer/h.1/Add_1_output_0"
# The layouts of each TorchScript export's tests, by run name: (pp, tp) or (pp, tp, sections). The first test of an
# export configures them all, each training as soon as it is configured (exports_checks.start_layouts); the gradient
# test reads the tp 2 run's artifacts.
LAYOUTS = {
    "gpt2.onnx": {"pp2-0": (2, 1), "pp1tp2": (1, 2),
                  "pp2tp2": (2, 2, {"model_fields": {"pipeline_cuts": [BLOCKS_1_2]}})},
    "bert.onnx": {"pp2tp1": (2, 1), "pp1tp2": (1, 2), "pp2tp2": (2, 2)},
    "rnn.onnx": {"pp2tp1": (2, 1), "pp1tp2": (1, 2), "pp2tp2": (2, 2)},
    "rnn-dynamo-noopt.onnx": {"pp2tp1": (2, 1), "pp1tp2": (1, 2), "pp2tp2": (2, 2)},
}


def _layout(reference, name: str):
    """The export's layout run of that name, its export's layouts started (:data:`LAYOUTS`)."""
    layouts = LAYOUTS[reference.cfg.model.path.name]
    start_layouts(reference, layouts)
    return reference.layouts[name]


@GPT2
def test_gpt2_two_stages_train_to_the_unsplit_parameters(export_dp):
    """Automatic cuts (the cut by hand is the pp 2 x tp 2 run's: :func:`test_gpt2_tensor_pieces_train_to_the_unsplit_
    parameters_also_in_two_stages_cut_by_hand`)."""
    run = _layout(export_dp, "pp2-0")
    assert_equal_to(export_dp, run.cfg, run.out)
    assert_exports_one_model(run.cfg)


@GPT2
@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2xtp2-blocks-1-2"])
def test_gpt2_tensor_pieces_train_to_the_unsplit_parameters_also_in_two_stages_cut_by_hand(export_dp, pp):
    """tp 2, and pp 2 x tp 2 with the stages cut by hand between blocks 1 and 2 (configure keeps the given cut)."""
    run = _layout(export_dp, f"pp{pp}tp2")
    cfg = run.cfg
    if pp > 1:
        assert json.loads((cfg.output_dir / "configure.json").read_text())["pipeline_cuts"] == [BLOCKS_1_2]
    split = split_lines(cfg, 1)
    for block in range(4):  # attention (fused QKV by heads) and MLP of every block, and the tied table by vocabulary
        assert any(f"h.{block}.attn.c_attn.weight" in line and "fused parts" in line for line in split), split
        assert any(f"columns ['model.transformer.h.{block}.mlp.c_fc.weight']" in line for line in split), split
    vocab = [line for line in split if "vocabulary split of ['model.transformer.wte.weight']" in line]
    assert len(vocab) == 2 and any("LM head ['logits']" in line for line in vocab), split
    assert_equal_to(export_dp, cfg, run.out, atol=TP_ATOL)
    assert_exports_one_model(cfg)


@pytest.mark.parametrize("export_dp", ["bert.onnx"], indirect=True)
@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2), (2, 2)], ids=["pp2", "tp2", "pp2xtp2"])
def test_bert_stages_and_tensor_pieces_train_to_the_unsplit_parameters(export_dp, pp, tp):
    run = _layout(export_dp, f"pp{pp}tp{tp}")
    cfg = run.cfg
    if tp > 1:  # every layer's attention (separate Q, K, V Linears by heads) and MLP
        split = split_lines(cfg, 1)
        for layer in range(2):
            prefix = f"model.bert.encoder.layer.{layer}"
            assert any(f"'{prefix}.attention.self.query.weight', '{prefix}.attention.self.key.weight'" in line
                       and f"rows ['{prefix}.attention.output.dense.weight']" in line for line in split), split
            assert any(f"columns ['{prefix}.intermediate.dense.weight']" in line for line in split), split
    assert_equal_to(export_dp, cfg, run.out, atol=TP_ATOL if tp > 1 else ATOL)


@pytest.mark.parametrize(("export_dp", "pp", "tp"),
                         [("rnn.onnx", 2, 1), ("rnn.onnx", 1, 2), ("rnn.onnx", 2, 2),
                          ("rnn-dynamo-noopt.onnx", 2, 1), ("rnn-dynamo-noopt.onnx", 1, 2),
                          ("rnn-dynamo-noopt.onnx", 2, 2)],
                         ids=["pp2", "tp2", "pp2xtp2", "dynamo-noopt-pp2", "dynamo-noopt-tp2", "dynamo-noopt-pp2xtp2"],
                         indirect=["export_dp"])
def test_rnn_stages_and_tensor_pieces_train_to_the_unsplit_parameters(export_dp, pp, tp):
    """The LSTM + GRU classifier (its TorchScript export, and its dynamo ``optimize=False`` export's torch parameters)
    cut between its LSTM and its GRU, and in tensor pieces: the embedding table split by vocabulary, the recurrent
    layers replicated (no tensor-parallel split of their own). At pp 2 x tp 2 the second stage (GRU and head) has
    nothing to split: each of its tensor-parallel ranks runs it whole, holding bitwise the same parameters."""
    import re

    import onnx

    run = _layout(export_dp, f"pp{pp}tp{tp}")
    cfg = run.cfg
    if pp > 1:  # the automatic cut is the LSTM node's output (TorchScript's '/lstm/LSTM_output_0', dynamo's 'val_NN')
        (cut,) = json.loads((cfg.output_dir / "configure.json").read_text())["pipeline_cuts"]
        graph = onnx.load(str(cfg.model.path), load_external_data=False).graph
        assert [n.op_type for n in graph.node if cut in n.output] == ["LSTM"], cut
    if tp > 1:
        split = split_lines(cfg, pp)
        assert any("vocabulary split of ['embed.weight']" in line for line in split), split
        assert not any("lstm." in line or "gru." in line for line in split if line.startswith("region")), split
    if pp > 1 and tp > 1:
        stages = split_lines(cfg, 1)
        assert "stage 1: no layer to split: each tensor-parallel rank runs the whole graph" in stages, stages
        # each rank logs the hash of all its parameters and of its replicated ones: a stage run whole replicates all
        hashes = re.findall(r"rank (\d+) parameters sha256 (\w+) \(replicated (\w+)\)", run.out.stdout)
        whole = {rank: mine for rank, mine, replicated in hashes if mine == replicated}
        assert len(hashes) == 4 and len(whole) == 2 and len(set(whole.values())) == 1, hashes
        assert_exports_one_model(cfg)
    assert_equal_to(export_dp, cfg, run.out, atol=TP_ATOL if tp > 1 else ATOL)


# The pieces add the row-parallel partial sums over the ranks, each rounded in halves: every gradient measured within
# 4.8e-7 of its parameter's largest unsplit entry (BERT tp 2). A wrong gradient is off by a whole term: a tensor of
# slices summed over the ranks differed by 1.0 of it.
GRAD_RTOL = 1e-5
# The attention key biases' exact gradient is zero (softmax ignores them); the engine's is rounding noise of 1e-11.
GRAD_NOISE = 1e-9


def _batch(name: str, root) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    if name == "bert.onnx":
        table = pq.read_table(bert_data(root)).slice(0, 2)
        return {c: np.array(table[c].to_pylist(), np.int64) for c in ("input_ids", "attention_mask", "labels")}
    ids = np.random.default_rng(0).integers(0, 512, (2, SEQ))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("export_dp", ["bert.onnx", "gpt2.onnx"], indirect=True)
def test_tensor_pieces_compute_every_parameters_unsplit_gradient(export_dp):
    """One micro-batch through the artifacts configure built for tp 2 and for one rank (the unsplit reference run's),
    the ranks simulated in one process (tests/support/tensor_sim.py), compared parameter by parameter."""
    from tests.support.tensor_sim import piece_gradients, whole_gradients

    whole_cfg = export_dp.cfg
    split_cfg = _layout(export_dp, "pp1tp2").cfg
    batch = _batch(whole_cfg.model.path.name, whole_cfg.output_dir.parent)

    loss, whole = whole_gradients(whole_cfg.artifacts_dir, batch)
    losses_, split, replicated = piece_gradients(split_cfg.artifacts_dir, batch)

    assert losses_ == [losses_[0]] * 2
    assert losses_[0] == pytest.approx(loss, rel=1e-6)
    assert sorted(split) == sorted(whole)
    differ = {}
    for param, g in whole.items():
        diff = float(np.abs(split[param] - g).max())
        if diff > GRAD_RTOL * float(np.abs(g).max()) + GRAD_NOISE:
            differ[param] = f"max |diff| {diff:.3g}, |unsplit| {np.linalg.norm(g):.4g}, " \
                            f"|split| {np.linalg.norm(split[param]):.4g}"
    assert not differ, f"gradients that differ from the unsplit model's: {differ}"
    for param, per_rank in replicated.items():  # the ranks keep bitwise the same replicated parameters
        assert all(np.array_equal(per_rank[0], g) for g in per_rank[1:]), param


# Torch's default exporter (dynamo) on the same models: configure trains each export's torch parameters under their
# torch names (ortflow/configure/torch_model.py), so every layout is compared with the unsplit run name by name.
DYNAMO = ("gpt2-dynamo-noopt.onnx", "gpt2-dynamo.onnx", "bert-dynamo.onnx", "bert-dynamo-noopt.onnx", "vit-dynamo.onnx",
          "vit-dynamo-noopt.onnx")
# The LSTM + GRU classifier's optimize=False export trains in pipeline stages and tensor pieces beside its TorchScript
# twin (test_rnn_stages_and_tensor_pieces_train_to_the_unsplit_parameters) and at dp 2 here; the fresh GPT-2's
# default export is refused before training (tests/test_fixture_exports.py).


@pytest.mark.parametrize("export_dp", DYNAMO, indirect=True)
@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2), (1, 2)], ids=["pp2", "pp2xtp2", "tp2"])
def test_dynamo_stages_and_tensor_pieces_train_to_the_unsplit_parameters(export_dp, pp, tp):
    assert_dynamo_layout_trains_to_the_unsplit_parameters(export_dp, pp, tp)


# The fresh 1-layer GPT-2 with sdpa attention (2 heads, the tied table), from TorchScript (its merged parameters
# untied by configure) and from dynamo with optimize=False (its CastLike trained as Cast): automatic cuts, tp 2 by
# heads (dynamo's keys split through their [batch * heads, seq, head_dim] transpose), dp 2, ZeRO-1 and Adasum.
SDPA = ("gpt2-sdpa.onnx", "gpt2-sdpa-dynamo-noopt.onnx")


@pytest.mark.parametrize("export_dp", SDPA, indirect=True)
@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2), (1, 2)], ids=["pp2", "pp2xtp2", "tp2"])
def test_sdpa_stages_and_tensor_pieces_train_to_the_unsplit_parameters(export_dp, pp, tp):
    """At tp 2 the block's attention (by heads) and MLP are split, and the tied table by vocabulary in the embedding
    and the LM head, on both exporters' graphs."""
    cfg = assert_dynamo_layout_trains_to_the_unsplit_parameters(export_dp, pp, tp)
    if tp > 1:
        vocab = [line for line in split_lines(cfg, pp)
                 if "vocabulary split of ['model.transformer.wte.weight']" in line]
        assert len(vocab) == 2 and any("LM head ['logits']" in line for line in vocab), vocab


@pytest.mark.parametrize("export_dp", [*DYNAMO, "rnn-dynamo-noopt.onnx", "bert.onnx", *SDPA], indirect=True)
def test_exports_train_their_torch_parameters_at_dp2_to_the_unsplit_ones(export_dp, export_dp2):
    """Every dynamo export here, and BERT's and the sdpa GPT-2's TorchScript exports (GPT-2's and the LSTM + GRU
    classifier's TorchScript exports train as their optimize=False twins: test_dynamo_noopt_export_trains_the_torch_
    parameters_as_its_torchscript_twin)."""
    assert_trains_its_torch_parameters_at_dp2(export_dp, export_dp2)


@pytest.mark.parametrize("export_dp", ["gpt2-dynamo-noopt.onnx", "rnn-dynamo-noopt.onnx", SDPA[1]], indirect=True)
def test_dynamo_noopt_export_trains_the_torch_parameters_as_its_torchscript_twin(export_references, export_dp,
                                                                                export_dp2):
    """The optimize=False dynamo export and the TorchScript export of the same model, each trained unsplit on the same
    seed and data (their reference runs): the same torch parameters are trained (no buffer), to the same values."""
    assert_trains_as_its_torchscript_twin(export_references, export_dp, export_dp2)


# ZeRO-1 and Adasum on every export of every family here that trains at dp 2: TorchScript, dynamo default and dynamo
# optimize=False (Llama's: test_llama_parallel_mpi.py; the CNN's, whose BatchNorm statistics differ per rank by
# design: test_batchnorm_mpi.py).
ZERO1_ADASUM = ["gpt2.onnx", "gpt2-dynamo.onnx", "gpt2-dynamo-noopt.onnx", "bert.onnx", "bert-dynamo.onnx",
                "bert-dynamo-noopt.onnx", "vit-dynamo.onnx", "vit-dynamo-noopt.onnx", "rnn.onnx",
                "rnn-dynamo-noopt.onnx", *SDPA]


@pytest.mark.parametrize("export_dp", ZERO1_ADASUM, indirect=True)
def test_exports_train_with_zero1_and_adasum(export_dp):
    """On 2 ranks, on the torch parameters: ZeRO-1 ends where the unsplit run (and so plain data parallelism) does;
    Adasum trains as the mean does."""
    assert_trains_with_zero1_and_adasum(export_dp)


def test_a_killed_rnn_run_on_two_ranks_resumes_bitwise(tmp_path):
    """The LSTM + GRU classifier (the dynamo export, optimize=False) on 2 ranks, killed between checkpoints and
    resumed, ends with the parameters of an uninterrupted run, bit for bit."""
    from ortflow.checkpoints import list_complete
    from tests.support.runs import kill_and_resume
    from tests.trainer.exports_runs import rnn_run

    settings = dict(export="rnn-dynamo-noopt.onnx", distributed={"num_ranks": 2},
                    train={"num_train_steps": 80, "gradient_accumulation_steps": 1, "evaluation_period": 0},
                    checkpoint={"period": 10, "max_num_checkpoints": 2})
    steady, killed = rnn_run(tmp_path, "steady", **settings), rnn_run(tmp_path, "killed", **settings)
    kill_and_resume(killed, min_step=30, end_step=80, timeout=300, beside=steady)
    a = read_params(list_complete(steady.checkpoints_dir)[-1].path)
    b = read_params(list_complete(killed.checkpoints_dir)[-1].path)
    assert sorted(a) == sorted(b) and "lstm.weight_hh_l0" in a
    for name in a:
        assert np.array_equal(a[name], b[name]), name
