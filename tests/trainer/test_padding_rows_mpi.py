"""Torch's ``padding_idx``: Gemma's embedding (row 0, tied to the LM head) and BERT's word embedding (row 0, untied)
train as torch's do on a batch whose ids hold the padding id at several positions: on one rank (read with ``GatherND``
and with ``Gather``), split by vocabulary over 2 tensor-parallel ranks, cut into 2 pipeline stages (the table in the
first) and both. The stage or piece reading the table runs its forward once and keeps its activations, its gradient
graph masked as its training model is; the pipeline run that recomputes the forward instead
(``recompute_forward: true``) trains to the same parameters.

The reference is torch's rule written into the graph (tests/support/padding_rows.py). Every other gradient of the
Gemma export is torch's (tests/trainer/test_exporter_patterns.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from tests.support.exports import EXPORTS, export_path
from tests.support.padding_rows import EXPORTS_BY_FAMILY, PAD, TABLES, bert_batch, frozen_copy_model, gemma_batch
from tests.support.parallel_runs import newest
from tests.support.runs import make_run, run_ranks_together

pytestmark = pytest.mark.mpi

#: Runs that must train to their family's reference, by name: (family, distributed section). ``gather`` reads the
#: table with ``Gather`` (gradient ``GatherGrad``), the others with the CPU's repeatable ``GatherND``.
RUNS = {"gemma-dp1": ("gemma", {}), "gemma-gather": ("gemma", {"deterministic_compute": False}),
        "gemma-tp2": ("gemma", {"num_ranks": 2, "horizontal_parallel_size": 2}),
        "gemma-pp2": ("gemma", {"num_ranks": 2, "pipeline_parallel_size": 2}),
        "gemma-pp2-gather": ("gemma", {"num_ranks": 2, "pipeline_parallel_size": 2, "deterministic_compute": False}),
        "gemma-pp2-recompute": ("gemma", {"num_ranks": 2, "pipeline_parallel_size": 2, "recompute_forward": True}),
        "gemma-pp2tp2": ("gemma", {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}),
        "bert-dp1": ("bert", {}), "bert-tp2": ("bert", {"num_ranks": 2, "horizontal_parallel_size": 2})}
#: One SGD step of lr 1 in other summation orders (test_exporter_patterns.py's bound); the padding positions'
#: gradient of the padding row is far above it (asserted below).
ATOL = 1e-6
#: The runs whose part reading the table (pipeline stage 0, or tensor-parallel piece 1 of rank 0) keeps its
#: activations: its gradient graph, built at rank start, is masked.
KEEPING = ["gemma-tp2", "gemma-pp2", "gemma-pp2-gather", "gemma-pp2tp2", "bert-tp2"]
#: Gemma's stage 0 keeping its activations against recomputing its forward: not bitwise (the forward-once gradient
#: graph is the engine's gradient of the eval model, whose kernels round differently from the training model's; the
#: unmasked frozen-copy export differs by the same 7.5e-9 at pp 2), at most an ulp of the largest values (0.12).
KEEP_VS_RECOMPUTE = 1e-7


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """One SGD step of lr 1 on each family's batch: its reference and each run of :data:`RUNS`; name -> config."""
    root = tmp_path_factory.mktemp("padding-rows")
    batches = {"gemma": gemma_batch(root), "bert": bert_batch(root)}

    def common(family):
        data = str(batches[family])
        return {"data": {"train": [data], "test": [data]},
                "train": {"batch_size": 8, "num_train_steps": 1, "gradient_accumulation_steps": 1,
                          "evaluation_period": 0},
                "optimizer": {"name": "sgd", "learning_rate": 1.0}, "checkpoint": {"period": 1}}

    # the copy is no torch parameter: configure makes it a constant (asserted below)
    cfgs = {f"{family}-reference": make_run(root, f"{family}-reference", model=frozen_copy_model(root, export),
                                            **common(family))
            for family, export in EXPORTS_BY_FAMILY.items()}
    cfgs.update({name: make_run(root, name, model=export_path(EXPORTS_BY_FAMILY[family]), distributed=dist,
                                **common(family)) for name, (family, dist) in RUNS.items()})
    outs = run_ranks_together(*cfgs.values())
    for out in outs:
        assert out.returncode == 0, out.stdout[-3000:]
    return {name: (cfg, out.stdout) for (name, cfg), out in zip(cfgs.items(), outs, strict=True)}


@pytest.mark.parametrize("run", RUNS)
def test_the_padding_row_gets_no_gradient_from_the_padding_positions_as_in_torch(steps, run):
    from safetensors.numpy import load_file

    family = RUNS[run][0]
    table = TABLES[family]
    reference_cfg = steps[f"{family}-reference"][0]
    record = json.loads((reference_cfg.output_dir / "configure.json").read_text())
    assert "padding_copy" in record["torch"]["frozen"] and "padding_copy" not in record["trainable"]
    start = load_file(str(EXPORTS / f"{family}.safetensors"))
    reference = read_params(newest(reference_cfg))
    trained = read_params(newest(steps[run][0]))
    assert table in trained
    for name in start:
        if name in trained:
            np.testing.assert_allclose(trained[name], reference[name], rtol=0, atol=ATOL, err_msg=name)
    moved = np.abs(trained[table][PAD] - start[table][PAD]).max()
    if family == "gemma":  # row 0 still trains from the tied LM head
        assert moved > 100 * ATOL
    else:  # the lookup is the table's only use: its padding row does not move
        assert moved == 0



def _piece_records(cfg, run):
    """The tensor-parallel pieces' records of the part holding the table (stage 0 of a pp x tp run)."""
    dist = RUNS[run][1]
    if dist.get("pipeline_parallel_size", 1) > 1:
        return json.loads((cfg.artifacts_dir / "pipetensor" / "pipetensor.json").read_text())["stages"][0]["pieces"]
    return json.loads((cfg.artifacts_dir / "tensor" / "tensor.json").read_text())["pieces"]


@pytest.mark.parametrize("run", KEEPING)
def test_the_part_reading_the_table_keeps_its_activations_with_its_gradient_graph_masked(steps, run):
    """The stage or piece holding the lookup runs its forward once (its gradient graph masked at rank start, as its
    training model is; the trained values are checked above), instead of recomputing it in the backward call."""
    family = RUNS[run][0]
    cfg, log = steps[run]
    rows = {TABLES[family]: PAD}
    if RUNS[run][1].get("horizontal_parallel_size", 1) == 1:
        record = json.loads((cfg.artifacts_dir / "stages" / "stages.json").read_text())
        assert record["stages"][0]["padding_rows"] == rows and record["stages"][1]["padding_rows"] == {}
        assert "rank 0 stage 0: forward once, activations kept until the backward" in log, log[-3000:]
        assert f"rank 0 stage 0: its gradient graph masks torch's padding rows {rows}" in log, log[-3000:]
        return
    pieces = _piece_records(cfg, run)
    # the vocabulary split: tensor-parallel rank 0 holds row 0 (its local row 0), rank 1 none of the padding rows
    masking = {info["index"]: info["padding_rows"] for info in pieces if any(info["padding_rows"])}
    assert masking == {1: [rows, {}]}, masking
    assert pieces[-1]["index"] != 1  # not the loss's piece, which trains in one call
    assert f"rank 0: kept pieces whose gradient graphs mask torch's padding rows: {{1: {rows}}}" in log, log[-3000:]


def test_a_stage_keeping_its_activations_trains_as_the_one_recomputing_its_forward(steps):
    """Gemma at pp 2: stage 0 keeping its activations (its gradient graph masked) and recomputing its forward in the
    training call (its training model masked) train to the same parameters, to float32 rounding
    (:data:`KEEP_VS_RECOMPUTE`)."""
    kept_cfg, kept_log = steps["gemma-pp2"]
    cfg, log = steps["gemma-pp2-recompute"]
    assert "rank 0 stage 0: forward recomputed inside the backward call" in log, log[-3000:]
    assert "gradient graph masks" not in log  # no forward-once calls: the training call masks
    kept, recomputed = read_params(newest(kept_cfg)), read_params(newest(cfg))
    assert sorted(kept) == sorted(recomputed)
    for name in kept:
        np.testing.assert_allclose(kept[name], recomputed[name], rtol=0, atol=KEEP_VS_RECOMPUTE, err_msg=name)
