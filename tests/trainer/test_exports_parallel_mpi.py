"""Pipeline and tensor parallelism on the real exports (tests/fixtures/exports), trained unmodified under mpiexec:
each layout ends where the unsplit run on the same global batch ends, and tensor pieces compute the unsplit model's
gradients."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from tests.support.parallel_runs import losses, newest
from tests.support.runs import copied_run, run_ranks_together, start_ranks
from tests.trainer.exports_runs import (
    SEQ,
    UPDATES,
    assert_export_equals_eval_graph,
    bert_data,
    bert_run,
    gpt2_run,
    vit_run,
)

pytestmark = pytest.mark.mpi

# Every layout computes the same ops on the same batch; what differs is where fp32 sums are grouped (a tied table's
# two uses summed per stage then across, per-rank partial products all-reduced, and the gradient graph a stage's
# separate forward and backward calls build from its forward graph, which sums BERT's embedding gradients in another
# order than its training call: up to 6e-8 relative). A gradient that differs by a few ulps moves a weight by a few
# ulps of the AdamW step, more where AdamW normalises a near-zero gradient (a rare token's embedding row): measured at
# most 1.2e-7 after 20 updates for pp 2 on GPT-2, 1.3e-6 on BERT (after the 4 updates the tests train: 1.2e-7 on GPT-2,
# 6.7e-7 on BERT). 5e-6 is above that and far below one update's change (lr = 1e-3).
ATOL = 5e-6
# Except the attention key biases: softmax is invariant to them (they add the same q.b_k to every score of a row), so
# their exact gradient is zero and what the engine computes is rounding noise, which AdamW normalises into steps of up
# to lr. Any regrouping of a sum changes that noise: measured up to 1.1e-5 after 20 updates (and after 4); the bound is
# 1e-4.
KEY_BIAS_ATOL = 1e-4
# Tensor pieces add the row-parallel partial sums over the ranks: each product is rounded in two halves, so gradients
# differ from the unsplit ones by a few ulps everywhere, and AdamW turns a few ulps of an element whose gradient is
# near zero (an MLP unit GELU keeps near zero on every token) into steps of up to lr: measured on GPT-2 after 20
# updates, every parameter within 2.4e-5 but one element of h.1's MLP projection 9.5e-5 (tp 2 and pp 2 x tp 2); on
# BERT tp 2 every parameter within 6.8e-6. After the 4 updates the tests train: 4.7e-5 on GPT-2, 1.3e-6 on BERT.
# The bound, 5e-4, is half of one update's change (lr = 1e-3): a wrong gradient moves weights by ~lr every update.
TP_ATOL = 5e-4


def key_bias(name: str, shape: tuple[int, ...]) -> slice | None:
    """The entries of a parameter that are attention key biases: the middle third of GPT-2's fused c_attn bias,
    all of BERT's and ViT's key bias."""
    if name.endswith("attn.c_attn.bias"):
        return slice(shape[0] // 3, 2 * shape[0] // 3)
    if name.endswith(("attention.self.key.bias", "attention.attention.key.bias")):
        return slice(None)
    return None


class Reference:
    """An unsplit reference run, started as soon as it is configured (its training overlaps the configuring of the
    runs compared to it); ``out`` waits for its end."""

    def __init__(self, cfg):
        self.cfg, self._job = cfg, start_ranks(cfg, timeout=600)

    @property
    def out(self):
        out = self._job.result()
        assert out.returncode == 0, out.stdout[-4000:]
        return out


def _train(*cfgs) -> list:
    """Train independent runs to their ends, at once; returns their outputs."""
    outs = run_ranks_together(*cfgs, timeout=600)
    for out in outs:
        assert out.returncode == 0, out.stdout[-4000:]
    return outs


@pytest.fixture(scope="module")
def gpt2_dp(tmp_path_factory):
    """The unsplit reference: one rank, the same global batch as every split layout."""
    root = tmp_path_factory.mktemp("gpt2")
    return Reference(gpt2_run(root, "dp", distributed={"num_ranks": 1}))


def _max_diffs(p1: dict, p2: dict) -> tuple[float, float]:
    """The largest |difference| of same-named parameters, outside and inside the attention key biases."""
    worst, worst_key = 0.0, 0.0
    for name in p1:
        diff = np.abs(p1[name] - p2[name])
        noise = key_bias(name, p1[name].shape)
        if noise is not None:
            worst_key = max(worst_key, float(diff[noise].max()))
            diff[noise] = 0
        worst = max(worst, float(diff.max()))
    return worst, worst_key


def _assert_equal_to(reference, cfg, out, atol=ATOL):
    ref_cfg, ref_out = reference.cfg, reference.out
    p1, p2 = read_params(newest(ref_cfg)), read_params(newest(cfg))
    assert sorted(p1) == sorted(p2)
    worst, worst_key = _max_diffs(p1, p2)
    print(f"{cfg.name}: max |param diff| vs unsplit after {UPDATES} updates: {worst:.3g} (key biases {worst_key:.3g})")
    assert worst < atol
    assert worst_key < KEY_BIAS_ATOL
    np.testing.assert_allclose(losses(out.stdout), losses(ref_out.stdout), rtol=1e-4)
    assert len(losses(out.stdout)) == UPDATES  # one loss per update
    evals = [[float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", o.stdout)] for o in (ref_out, out)]
    assert len(evals[1]) == 2
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)


@pytest.mark.parametrize("cuts", [(), ("/model/transformer/h.1/Add_1_output_0",)], ids=["automatic", "blocks-1-2"])
def test_gpt2_two_stages_train_to_the_unsplit_parameters(gpt2_dp, cuts):
    root = gpt2_dp.cfg.output_dir.parent
    cfg = gpt2_run(root, f"pp2-{len(cuts)}", model_fields={"pipeline_cuts": list(cuts)},
                   distributed={"num_ranks": 2, "pipeline_parallel_size": 2})
    _assert_equal_to(gpt2_dp, cfg, *_train(cfg))
    _assert_exports_one_model(cfg)


def _assert_exports_one_model(cfg):
    """The split run exports one model (stages and slices stitched) whose logits equal the unsplit eval graph's."""
    from ortflow.export.model import export_model

    out = cfg.output_dir / "exported.onnx"
    result = export_model(cfg.output_dir, out, config=cfg)
    assert max(result.verification.max_abs_diff.values()) <= 1e-5
    ids = np.random.default_rng(0).integers(0, 512, (3, SEQ))  # a batch size no run used
    assert_export_equals_eval_graph(cfg, out, read_params(newest(cfg)), {"input_ids": ids})


@pytest.fixture(scope="module")
def configured():
    """The split runs configured so far, by (reference run folder, pp, tp): the training tests and the gradient test
    (:func:`test_tensor_pieces_compute_every_parameters_unsplit_gradient`) share them."""
    return {}


def _configured_split(configured: dict, reference, make, pp: int, tp: int):
    """``make``'s run of ``reference``'s model and data at pp x tp, configured once."""
    key = (reference.output_dir, pp, tp)
    if key not in configured:
        configured[key] = make(reference.output_dir.parent, f"pp{pp}tp{tp}", export=reference.model.path.name,
                               distributed={"num_ranks": pp * tp, "pipeline_parallel_size": pp,
                                            "horizontal_parallel_size": tp})
    return configured[key]


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2xtp2"])
def test_gpt2_tensor_pieces_train_to_the_unsplit_parameters(gpt2_dp, configured, pp):
    cfg = _configured_split(configured, gpt2_dp.cfg, gpt2_run, pp, 2)
    split = json.loads((cfg.output_dir / "configure.json").read_text())["tensor_parallel_split"]
    for block in range(4):  # attention (fused QKV by heads) and MLP of every block, and the tied table by vocabulary
        assert any(f"h.{block}.attn.c_attn.weight" in line and "fused parts" in line for line in split), split
        assert any(f"columns ['model.transformer.h.{block}.mlp.c_fc.weight']" in line for line in split), split
    vocab = [line for line in split if "vocabulary split of ['model.transformer.wte.weight']" in line]
    assert len(vocab) == 2 and any("LM head ['logits']" in line for line in vocab), split
    _assert_equal_to(gpt2_dp, cfg, *_train(cfg), atol=TP_ATOL)
    _assert_exports_one_model(cfg)


@pytest.fixture(scope="module")
def bert_dp(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert")
    return Reference(bert_run(root, "dp", distributed={"num_ranks": 1}))


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2), (2, 2)], ids=["pp2", "tp2", "pp2xtp2"])
def test_bert_stages_and_tensor_pieces_train_to_the_unsplit_parameters(bert_dp, configured, pp, tp):
    cfg = _configured_split(configured, bert_dp.cfg, bert_run, pp, tp)
    if tp > 1:  # every layer's attention (separate Q, K, V Linears by heads) and MLP
        split = json.loads((cfg.output_dir / "configure.json").read_text())["tensor_parallel_split"]
        for layer in range(2):
            prefix = f"model.bert.encoder.layer.{layer}"
            assert any(f"'{prefix}.attention.self.query.weight', '{prefix}.attention.self.key.weight'" in line
                       and f"rows ['{prefix}.attention.output.dense.weight']" in line for line in split), split
            assert any(f"columns ['{prefix}.intermediate.dense.weight']" in line for line in split), split
    _assert_equal_to(bert_dp, cfg, *_train(cfg), atol=TP_ATOL if tp > 1 else ATOL)


# The pieces add the row-parallel partial sums over the ranks, each rounded in halves: every gradient measured within
# 4.8e-7 of its parameter's largest unsplit entry (BERT tp 2). A wrong gradient is off by a whole term: a tensor of
# slices summed over the ranks differed by 1.0 of it.
GRAD_RTOL = 1e-5
# The attention key biases' exact gradient is zero (softmax ignores them); the engine's is rounding noise of 1e-11.
GRAD_NOISE = 1e-9


def _batch(name: str, root) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq

    if name == "bert":
        table = pq.read_table(bert_data(root)).slice(0, 2)
        return {c: np.array(table[c].to_pylist(), np.int64) for c in ("input_ids", "attention_mask", "labels")}
    ids = np.random.default_rng(0).integers(0, 512, (2, SEQ))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_tensor_pieces_compute_every_parameters_unsplit_gradient(request, configured, name):
    """One micro-batch through the artifacts configure built for tp 2 and for one rank (the unsplit reference run's),
    the ranks simulated in one process (tests/support/tensor_sim.py), compared parameter by parameter."""
    from tests.support.tensor_sim import piece_gradients, whole_gradients

    whole_cfg = request.getfixturevalue(f"{name}_dp").cfg
    split_cfg = _configured_split(configured, whole_cfg, bert_run if name == "bert" else gpt2_run, 1, 2)
    batch = _batch(name, whole_cfg.output_dir.parent)

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


# The two exporters write the same model with differently ordered fp32 ops (Llama: TorchScript folds RoPE's cos/sin
# tables into constants, dynamo computes them from inv_freq in the graph; RMSNorm's mean and rsqrt are written
# apart), so gradients differ by a few ulps and AdamW turns an element whose gradient is near zero into a step of up
# to lr: measured after 20 updates of one micro-batch of 2 per rank on 2 ranks, GPT-2 bit for bit (0), Llama at most
# 1.34e-5 (median 1.9e-9) on weights that moved 1e-2 (1.6e-6 with two micro-batches per rank: the smaller the batch,
# the more elements with a near-zero gradient); after the 4 updates the test trains, 1.5e-6. The bound, 5e-5, is a
# twentieth of one update's change (lr = 1e-3).
EXPORTER_ATOL = 5e-5

# Torch's default exporter (dynamo) on the same models: configure trains each export's torch parameters under their
# torch names (ortflow/configure/torch_model.py), so every layout is compared with the unsplit run name by name.
DYNAMO = ("gpt2-dynamo-noopt.onnx", "llama-dynamo-noopt.onnx", "gpt2-dynamo.onnx", "llama-dynamo.onnx",
          "bert-dynamo.onnx")
# The other dynamo fixtures that configure (gpt2-fresh-dynamo is refused before training: tests/test_fixture_exports.py)
# train at dp 2 only: their families' layouts are covered above, and ViT's split is BERT's.
DYNAMO_DP_ONLY = ("bert-dynamo-noopt.onnx", "vit-dynamo.onnx", "vit-dynamo-noopt.onnx", "llama-fresh-dynamo.onnx")
# Each family's attention and MLP projections (the first column-split weight of each region) and its blocks.
REGIONS = {"gpt2": ((".attn.c_attn.", ".mlp.c_fc."), 4), "llama": ((".self_attn.q_proj.", ".mlp.gate_proj."), 2),
           "bert": ((".attention.self.query.", ".intermediate.dense."), 2)}


def _family(export: str) -> str:
    return export.split("-")[0]


def _dynamo_run(root, name, export, **sections):
    run = {"bert": bert_run, "vit": vit_run}.get(_family(export), gpt2_run)
    return run(root, name, export=export, **sections)


@pytest.fixture(scope="module")
def dynamo_dp(request, tmp_path_factory):
    """The unsplit reference of a dynamo export (parametrised by the tests that use it): one rank, the same global
    batch as every other layout."""
    root = tmp_path_factory.mktemp(request.param.removesuffix(".onnx"))
    return Reference(_dynamo_run(root, "dp", request.param, distributed={"num_ranks": 1}))


# dp 2 on the unsplit run's global batch: UPDATES updates of one micro-batch of 2 per rank (the unsplit run sums 2).
DP2_TRAIN = {"gradient_accumulation_steps": 1, "num_train_steps": UPDATES}


@pytest.fixture(scope="module")
def dynamo_dp2(dynamo_dp):
    """dp 2 on the reference's global batch: one micro-batch of 2 per rank and update (the reference sums 2); its
    artifacts are the reference's (the same model and layout), copied."""
    ref = dynamo_dp.cfg
    cfg = copied_run(ref, _dynamo_run, ref.output_dir.parent, "dp2", export=ref.model.path.name, train=DP2_TRAIN,
                     distributed={"num_ranks": 2})
    return cfg, *_train(cfg)


@pytest.mark.parametrize("dynamo_dp", DYNAMO, indirect=True)
@pytest.mark.parametrize("pp,tp", [(2, 1), (2, 2)], ids=["pp2", "pp2xtp2"])
def test_dynamo_stages_and_tensor_pieces_train_to_the_unsplit_parameters(dynamo_dp, pp, tp):
    _assert_dynamo_layout_trains_to_the_unsplit_parameters(dynamo_dp, pp, tp)


# The Llama exports' tp 2 is test_llama_parallel_mpi.py's: the very run (same export, data and steps) against its own
# unsplit run, with these assertions and more (each rank's slice shapes, a tighter bound).
@pytest.mark.parametrize("dynamo_dp", [e for e in DYNAMO if _family(e) != "llama"], indirect=True)
def test_dynamo_tensor_pieces_train_to_the_unsplit_parameters(dynamo_dp):
    _assert_dynamo_layout_trains_to_the_unsplit_parameters(dynamo_dp, 1, 2)


def _assert_dynamo_layout_trains_to_the_unsplit_parameters(dynamo_dp, pp: int, tp: int) -> None:
    root = dynamo_dp.cfg.output_dir.parent
    cfg = _dynamo_run(root, f"pp{pp}tp{tp}", dynamo_dp.cfg.model.path.name,
                      distributed={"num_ranks": pp * tp, "pipeline_parallel_size": pp, "horizontal_parallel_size": tp})
    if tp > 1:  # every block's attention (by heads) and MLP are split, as on the TorchScript exports
        split = json.loads((cfg.output_dir / "configure.json").read_text())["tensor_parallel_split"]
        if pp > 1:
            split = [line.split(": ", 1)[1] for line in split]
        markers, blocks = REGIONS[_family(dynamo_dp.cfg.model.path.name)]
        for marker in markers:
            regions = [line for line in split if line.startswith("region") and line.split(", rows")[0].count(marker)]
            assert len(regions) == blocks, (marker, split)
        assert not [line for line in split if line.startswith("kept") and any(m in line for m in markers)], split
    _assert_equal_to(dynamo_dp, cfg, *_train(cfg), atol=TP_ATOL if tp > 1 else ATOL)


@pytest.mark.parametrize("dynamo_dp", [*DYNAMO, *DYNAMO_DP_ONLY], indirect=True)
def test_every_dynamo_export_trains_its_torch_parameters_at_dp2_to_the_unsplit_ones(dynamo_dp, dynamo_dp2):
    from tests.support.exports import torch_record

    cfg, out = dynamo_dp2
    info = json.loads((cfg.output_dir / "configure.json").read_text())
    assert sorted(info["trainable"]) == sorted(torch_record(_family(cfg.model.path.name))["parameters"])
    _assert_equal_to(dynamo_dp, cfg, out)


@pytest.mark.parametrize("dynamo_dp", ["gpt2-dynamo-noopt.onnx", "llama-dynamo-noopt.onnx"], indirect=True)
def test_dynamo_noopt_export_trains_the_torch_parameters_as_its_torchscript_twin(dynamo_dp, dynamo_dp2, gpt2_dp):
    """dp 2 on the optimize=False dynamo export and on the TorchScript export of the same model, same seed and data:
    the same torch parameters are trained (no buffer), to the same values."""
    from tests.support.exports import torch_record

    (noopt, noopt_out), family = dynamo_dp2, _family(dynamo_dp.cfg.model.path.name)
    script = {"export": f"{family}.onnx", "train": DP2_TRAIN, "distributed": {"num_ranks": 2}}
    script_cfg = (copied_run(gpt2_dp.cfg, gpt2_run, noopt.output_dir.parent, "torchscript", **script)
                  if family == "gpt2" else gpt2_run(noopt.output_dir.parent, "torchscript", **script))
    (script_out,) = _train(script_cfg)
    record = torch_record(family)
    info = json.loads((noopt.output_dir / "configure.json").read_text())
    assert sorted(info["trainable"]) == sorted(record["parameters"])
    assert set(record["buffers"]).isdisjoint(info["trainable"])
    script, dynamo = read_params(newest(script_cfg)), read_params(newest(noopt))
    trained = {n: v for n, v in dynamo.items() if n in record["parameters"]}
    assert sorted(trained) == sorted(record["parameters"])
    worst, worst_key = _max_diffs(trained, script)
    median = float(np.median(np.concatenate([np.abs(v - script[n]).ravel() for n, v in trained.items()])))
    print(f"{family}: dynamo optimize=False vs TorchScript after {UPDATES} updates on 2 ranks: max |param diff| "
          f"{worst:.3g} (key biases {worst_key:.3g}, median {median:.3g})")
    assert worst < EXPORTER_ATOL
    assert worst_key < KEY_BIAS_ATOL
    np.testing.assert_allclose(losses(noopt_out.stdout), losses(script_out.stdout), rtol=1e-5)
    _assert_state_dict_holds_the_trained_values(noopt, dynamo, record)
    _assert_exports_one_model(noopt)  # and the ONNX way out works as for TorchScript


def _assert_state_dict_holds_the_trained_values(cfg, trained: dict, record: dict) -> None:
    """``ortflow export RUN --state-dict`` writes every torch state-dict key (tied names too) with its torch shape and
    the trained values, under the Hugging Face model's own names (the fixtures' wrapper prefix ``model.`` stripped)."""
    from safetensors.numpy import load_file
    from typer.testing import CliRunner

    from ortflow.cli import app

    out = cfg.output_dir / "weights.safetensors"
    result = CliRunner().invoke(app, ["export", str(cfg.output_dir), "--state-dict", str(out), "--checkpoint",
                                      "latest", "--strip-prefix", "model."])
    assert result.exit_code == 0, result.output
    written = load_file(str(out))
    assert sorted(written) == sorted(k.removeprefix("model.") for k in record["state_dict"])
    tied = {alias: name for name, alias in record["tied"]}
    for key, shape in record["state_dict"].items():
        value = written[key.removeprefix("model.")]
        assert list(value.shape) == shape, key
        np.testing.assert_array_equal(value, trained[tied.get(key, key)], err_msg=key)


def _steps(cfg, params: dict, trained: list[str]) -> np.ndarray:
    """What training moved the trained parameters by, flattened: the final values less the torch-named model's (the
    weights training started from, written by configure beside the artifacts)."""
    import onnx
    from onnx import numpy_helper

    model = next((cfg.output_dir / "torch-model").glob("*.onnx"))
    start = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer}
    return np.concatenate([(params[n] - start[n]).ravel() for n in sorted(trained)])


@pytest.mark.parametrize("dynamo_dp", ["llama-dynamo.onnx", "gpt2-dynamo.onnx", "bert-dynamo.onnx"], indirect=True)
def test_dynamo_export_trains_with_zero1_and_adasum(dynamo_dp, dynamo_dp2):
    """The default (optimize=True) exports on 2 ranks, both on the torch parameters: ZeRO-1 ends where plain data
    parallelism does; Adasum trains as it does (its combination of the ranks' gradients differs from the mean by
    design, so it moves the weights in nearly the same direction by about as much)."""
    from tests.support.exports import torch_record

    (dp2, dp2_out), export = dynamo_dp2, dynamo_dp.cfg.model.path.name
    runs = {name: copied_run(dp2, _dynamo_run, dp2.output_dir.parent, name, export=export, train=DP2_TRAIN,
                             distributed={"num_ranks": 2, **extra})
            for name, extra in (("zero1", {"zero_stage": 1}), ("adasum", {"enable_adasum": True}))}
    outs = dict(zip(runs, _train(*runs.values()), strict=True))
    record = torch_record(_family(export))
    for name, cfg in runs.items():
        info = json.loads((cfg.output_dir / "configure.json").read_text())
        assert sorted(info["trainable"]) == sorted(record["parameters"]), name
    params = {name: read_params(newest(cfg)) for name, cfg in (("dp2", dp2), *runs.items())}
    worst, worst_key = _max_diffs(params["dp2"], params["zero1"])
    assert worst < ATOL and worst_key < KEY_BIAS_ATOL
    adasum, mean = losses(outs["adasum"].stdout), losses(dp2_out.stdout)
    assert len(adasum) == UPDATES and np.isfinite(adasum).all() and adasum[0] == mean[0]  # same start, same batch
    ada, dp = (_steps(runs["adasum"], params[name], list(record["parameters"])) for name in ("adasum", "dp2"))
    cosine, ratio = float(ada @ dp / np.linalg.norm(ada) / np.linalg.norm(dp)), np.linalg.norm(ada) / np.linalg.norm(dp)
    print(f"{export}: Adasum's step vs dp 2's after {UPDATES} updates: cosine {cosine:.3f}, norm ratio {ratio:.3f}")
    # measured after 20 updates: cosine 0.94 (GPT-2), 0.96 (Llama), 0.88 (BERT), norm ratio 1.11 to 1.24; after 4:
    # cosine 0.90, 0.89, 0.82, norm ratio 1.20 to 1.32
    assert cosine > 0.7 and 0.5 < ratio < 2
