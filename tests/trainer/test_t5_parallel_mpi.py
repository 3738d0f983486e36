"""Data, pipeline and tensor parallelism, ZeRO-1 and Adasum on the Hugging Face T5 exports (an encoder and a decoder
stack with cross-attention; three inputs, ``input_ids``, ``attention_mask`` and ``decoder_input_ids``, and a label per
decoder token; one relative position bias table per stack; the shared embedding read by both stacks and the LM head),
trained unmodified under mpiexec, each layout against the one unsplit run of its export on the same global batch (the
``export_dp`` fixture; what is compared: tests/trainer/exports_checks.py). The TorchScript export and the dynamo
exports (default and optimize=False) train their torch parameters at dp 2, the shared embedding as torch's one
``shared.weight``, and write the state dict with its three tied aliases; the optimize=False export trains as its
TorchScript twin. In two stages the automatic cut is where the encoder ends (its final norm's output, which every
decoder layer's cross-attention reads). At tp 2 the MLPs are split and the shared table by vocabulary in its three
uses; the attention is kept whole on every rank (the relative position bias, computed once per stack and added to
every layer's scores, is not split by heads), with a warning naming it.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from ortflow.checkpoints.tools import merge
from tests.support.exports import torch_record
from tests.support.parallel_runs import newest
from tests.trainer.exports_checks import (
    TP_ATOL,
    assert_equal_to,
    assert_state_dict_holds_the_trained_values,
    assert_trains_as_its_torchscript_twin,
    assert_trains_its_torch_parameters_at_dp2,
    assert_trains_with_zero1_and_adasum,
    split_lines,
    start_layouts,
)

pytestmark = pytest.mark.mpi

SCRIPT, DYNAMO, NOOPT = "t5.onnx", "t5-dynamo.onnx", "t5-dynamo-noopt.onnx"
#: The tied names of the shared table that the TorchScript export does not record.
SCRIPT_UNNAMED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
#: The end of the encoder, in each export's names: the automatic two-stage cut.
ENCODER_OUT = {SCRIPT: "/model/encoder/final_layer_norm/Mul_1_output_0", DYNAMO: "mul_397", NOOPT: "mul_397"}
#: The layouts of each export's tests, by run name: (pp, tp). The first test of an export configures them all, each
#: training as soon as it is configured (exports_checks.start_layouts).
LAYOUTS = {SCRIPT: {"pp2tp1": (2, 1), "pp1tp2": (1, 2), "pp2tp2": (2, 2), "pp1tp4": (1, 4)},
           DYNAMO: {"pp2tp1": (2, 1), "pp1tp2": (1, 2)}, NOOPT: {"pp2tp1": (2, 1), "pp1tp2": (1, 2)}}


@pytest.mark.parametrize("export_dp", [SCRIPT, DYNAMO, NOOPT], indirect=True)
def test_t5_trains_its_torch_parameters_at_dp2_and_writes_the_torch_state_dict(export_dp, export_dp2):
    """Exactly torch's parameters are trained (``shared.weight`` once, with the sum of the gradients of its two
    embeddings and the LM head), dp 2 ends where the unsplit run does, and ``ortflow export --state-dict`` writes
    every torch key, ``encoder.embed_tokens.weight``, ``decoder.embed_tokens.weight`` and ``lm_head.weight`` holding
    the trained shared table; from the TorchScript export all but the two ``embed_tokens`` names, which it does not
    record (TorchScript names the shared module ``shared`` in both stacks' scopes)."""
    assert_trains_its_torch_parameters_at_dp2(export_dp, export_dp2)
    cfg = export_dp2[0]
    unnamed = SCRIPT_UNNAMED if cfg.model.path.name == SCRIPT else ()
    assert_state_dict_holds_the_trained_values(cfg, read_params(newest(cfg)), torch_record("t5"), unnamed)


@pytest.mark.parametrize("export_dp", [NOOPT], indirect=True)
def test_t5_dynamo_noopt_export_trains_as_its_torchscript_twin(export_references, export_dp, export_dp2):
    assert_trains_as_its_torchscript_twin(export_references, export_dp, export_dp2)


@pytest.mark.parametrize("export_dp", [SCRIPT, DYNAMO, NOOPT], indirect=True)
def test_t5_two_stages_cut_after_the_encoder_train_to_the_unsplit_parameters(export_dp):
    """The automatic cut is the encoder's output (its final norm): the first stage holds the encoder, the second the
    decoder, which reads the encoder's output in every layer's cross-attention; the shared table is held by both."""
    export = export_dp.cfg.model.path.name
    start_layouts(export_dp, LAYOUTS[export])
    run = export_dp.layouts["pp2tp1"]
    info = json.loads((run.cfg.output_dir / "configure.json").read_text())
    assert info["pipeline_cuts"] == [ENCODER_OUT[export]], info["pipeline_cuts"]
    assert_equal_to(export_dp, run.cfg, run.out)


#: tp 2 on every export, pp 2 x tp 2 and tp 4 (one head per rank) on the TorchScript export.
TENSOR = [pytest.param(SCRIPT, 1, 2, id="tp2-t5.onnx"), pytest.param(SCRIPT, 2, 2, id="pp2xtp2-t5.onnx"),
          pytest.param(SCRIPT, 1, 4, id="tp4-t5.onnx"), pytest.param(DYNAMO, 1, 2, id="tp2-t5-dynamo.onnx"),
          pytest.param(NOOPT, 1, 2, id="tp2-t5-dynamo-noopt.onnx")]
#: The heads, the width of each head (``d_kv``) and the relative position buckets of tools/export_fixtures.py's T5.
HEADS, HEAD_DIM, NUM_BUCKETS = 4, 16, 8
TABLES = [f"model.{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight" for stack in ("encoder",
                                                                                                       "decoder")]


@pytest.mark.parametrize("export_dp,pp,tp", TENSOR, indirect=["export_dp"])
def test_t5_tensor_pieces_split_the_attention_by_heads_with_the_bias_tables_columns_and_train_to_the_unsplit_parameters(
        export_dp, pp, tp):
    """Every attention is split by heads: the 4 self-attentions each with its heads' columns of its stack's relative
    position bias table, the 2 cross-attentions each with its heads' block of the zero bias plus the mask; every MLP
    (``wi`` by columns, ``wo`` by rows) and the shared table by vocabulary in both embeddings and the LM head; nothing
    is kept replicated. Each rank's checkpoint holds its heads of ``q``, ``k``, ``v``, ``o`` and its columns of each
    table, the whole tensors' values; the run ends where the unsplit one does, and the merged checkpoint and the torch
    state dict hold the whole trained tables."""
    export = export_dp.cfg.model.path.name
    start_layouts(export_dp, LAYOUTS[export])
    run = export_dp.layouts[f"pp{pp}tp{tp}"]
    split = split_lines(run.cfg, pp)
    assert not [line for line in split if line.startswith("kept replicated")], split
    heads = f"4 -> {HEADS // tp} per rank"
    for kind, count in (("SelfAttention", 4), ("EncDecAttention", 2)):
        lines = [line for line in split if line.startswith("region") and f".{kind}.q." in line.split(", rows")[0]]
        assert len(lines) == count and all(f"{kind}.q.weight {heads}" in line for line in lines), split
        for line in lines:
            table = TABLES[0] if ".encoder." in line else TABLES[1]
            assert (f"relative position bias tables by their heads' columns ['{table}']" in line) == (
                kind == "SelfAttention"), line
            assert ("biases without parameters, each rank its heads' block" in line) == (kind == "EncDecAttention")
    mlps = [line for line in split if line.startswith("region") and ".DenseReluDense.wi." in line.split(", rows")[0]]
    assert len(mlps) == 4, split
    vocab = [line for line in split if "vocabulary split of ['model.shared.weight']" in line]
    assert len(vocab) == 3 and any("in the LM head ['logits']" in line for line in vocab), split
    assert_equal_to(export_dp, run.cfg, run.out, atol=TP_ATOL)
    trained = read_params(newest(run.cfg))
    assert_rank_slices_hold_their_heads(newest(run.cfg), trained, tp)
    out = run.cfg.output_dir.parent / f"{run.cfg.name}-merged.h5"
    merge(newest(run.cfg), out)
    with h5py.File(out, "r") as f:
        whole = {ds.attrs["name"]: ds[()] for ds in f["parameters"].values()}
    for table in TABLES:  # the whole table (it equals the unsplit run's: assert_equal_to), its columns in place
        assert whole[table].shape == (NUM_BUCKETS, HEADS)
        np.testing.assert_array_equal(whole[table], trained[table])
    unnamed = SCRIPT_UNNAMED if export == SCRIPT else ()
    assert_state_dict_holds_the_trained_values(run.cfg, trained, torch_record("t5"), unnamed)


def assert_rank_slices_hold_their_heads(folder, whole: dict, tp: int) -> None:
    """Tensor-parallel rank ``r``'s parameter files (of every stage) hold heads ``[r H/tp, (r+1) H/tp)``: those rows of
    each attention's ``q``, ``k``, ``v`` (``[out, in]``), those columns of its ``o`` and of each relative position bias
    table (recorded as sliced on axis 1), each equal to the whole trained tensor's."""
    width = HEADS // tp * HEAD_DIM
    for r in range(tp):
        held = {}
        for path in sorted(folder.glob(f"params*-tp{r:02d}-of-{tp:02d}.h5")):
            with h5py.File(path, "r") as f:
                held.update({ds.attrs["name"]: (ds[()], dict(ds.attrs)) for ds in f["parameters"].values()})
        for table in TABLES:
            value, attrs = held[table]
            assert value.shape == (whole[table].shape[0], HEADS // tp) and int(attrs["tp_axis"]) == 1, table
            np.testing.assert_array_equal(value, whole[table][:, r * HEADS // tp:(r + 1) * HEADS // tp])
        projections = [n for n in whole if n.endswith(("Attention.q.weight", "Attention.k.weight",
                                                       "Attention.v.weight", "Attention.o.weight"))]
        assert len(projections) == 24
        for name in projections:
            value = held[name][0]
            block = slice(r * width, (r + 1) * width)
            expected = whole[name][:, block] if name.endswith(".o.weight") else whole[name][block]
            np.testing.assert_array_equal(value, expected, err_msg=name)


@pytest.mark.parametrize("export_dp", [SCRIPT, NOOPT], indirect=True)
def test_t5_trains_with_zero1_and_adasum(export_dp):
    assert_trains_with_zero1_and_adasum(export_dp)
