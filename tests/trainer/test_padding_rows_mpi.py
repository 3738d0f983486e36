"""Torch's ``padding_idx``: Gemma's embedding (row 0, tied to the LM head) and BERT's word embedding (row 0, untied)
train as torch's do on a batch whose ids hold the padding id at several positions: on one rank (read with ``GatherND``
and with ``Gather``), split by vocabulary over 2 tensor-parallel ranks, cut into 2 pipeline stages (the table in the
first) and both. The stage or piece reading the table runs its forward once and keeps its activations, its gradient
graph masked as its training model is; the pipeline run that recomputes the forward instead
(``recompute_forward: true``) trains to the same parameters.

The reference is torch's rule written into the graph: the same export with the padding positions reading a frozen
copy of the table (``Where(ids == 0, Gather(copy, ids), Gather(table, ids))``: the same values, and the lookup's
gradient reaches the table from the other positions only, a tied LM head's in full), its Gather's torch record
without ``padding_idx`` so configure's masking does not apply to it. Every other gradient of the Gemma export is
torch's (tests/trainer/test_exporter_patterns.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from ortflow.checkpoints.h5state import read_params
from ortflow.graph.exports.torch_params import FX_NODE
from tests.support.exports import EXPORTS, export_path
from tests.support.parallel_runs import newest
from tests.support.runs import make_run, run_ranks_together

pytestmark = pytest.mark.mpi

PAD = 0
#: The exports with torch's padding_idx 0, by family: Gemma's table is tied to its LM head, BERT's is not.
EXPORTS_BY_FAMILY = {"gemma": "gemma-dynamo-noopt.onnx", "bert": "bert-dynamo.onnx"}
TABLES = {"gemma": "model.model.embed_tokens.weight", "bert": "model.bert.embeddings.word_embeddings.weight"}
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


def _gemma_batch(root):
    """Gemma's torch batch (8 rows of 16 tokens) with the padding id at the ends of the rows and once inside one."""
    from safetensors.numpy import load_file

    batch = load_file(str(EXPORTS / "gemma.grads.safetensors"))
    ids = batch["input.input_ids"].copy()
    ids[:, -3:] = PAD
    ids[0, 2] = PAD
    path = root / "gemma.npz"
    np.savez(path, input_ids=ids, labels=batch["labels"])
    return path


def _bert_batch(root):
    """8 rows of 16 tokens for the BERT classifier: the padding id at attended positions (their gradient reaches the
    table) and at the masked ends of some rows."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 512, (8, 16))
    ids[:, 3] = PAD
    mask = np.ones_like(ids)
    mask[:4, -4:] = 0
    ids[:4, -4:] = PAD
    path = root / "bert.npz"
    np.savez(path, input_ids=ids, attention_mask=mask, labels=rng.integers(0, 3, 8))
    return path


def _frozen_copy_model(root, export):
    """The export with the padding positions' lookup reading a frozen copy of the table (module docstring)."""
    model = onnx.load(str(export_path(export)))
    graph = model.graph
    (lookup,) = [n for n in graph.node if n.op_type == "Gather" and any(
        p.key == FX_NODE and "aten.embedding" in p.value and f", {PAD}), kwargs" in p.value for p in n.metadata_props)]
    for prop in lookup.metadata_props:  # torch's record without padding_idx (-1): configure does not mask it
        if prop.key == FX_NODE:
            prop.value = prop.value.replace(f", {PAD}), kwargs", ", -1), kwargs")
    table = next(t for t in graph.initializer if t.name == lookup.input[0])  # the export's name of the table
    graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(table), "padding_copy"))
    y, ids = lookup.output[0], lookup.input[1]
    lookup.output[0] = "trained_rows"
    consts = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.asarray(v, np.int64), n))
              for n, v in (("pad_id", PAD), ("pad_axes", [-1]))]
    added = [*consts, helper.make_node("Gather", ["padding_copy", ids], ["copied_rows"], axis=0),
             helper.make_node("Equal", [ids, "pad_id"], ["is_pad"]),
             helper.make_node("Unsqueeze", ["is_pad", "pad_axes"], ["is_pad_row"]),
             helper.make_node("Where", ["is_pad_row", "copied_rows", "trained_rows"], [y])]
    at = list(graph.node).index(lookup) + 1
    nodes = [*graph.node[:at], *added, *graph.node[at:]]
    del graph.node[:]
    graph.node.extend(nodes)
    path = root / export.replace("-dynamo", "-frozen-copy")
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """One SGD step of lr 1 on each family's batch: its reference and each run of :data:`RUNS`; name -> config."""
    root = tmp_path_factory.mktemp("padding-rows")
    batches = {"gemma": _gemma_batch(root), "bert": _bert_batch(root)}

    def common(family):
        data = str(batches[family])
        return {"data": {"train": [data], "test": [data]},
                "train": {"batch_size": 8, "num_train_steps": 1, "gradient_accumulation_steps": 1,
                          "evaluation_period": 0},
                "optimizer": {"name": "sgd", "learning_rate": 1.0}, "checkpoint": {"period": 1}}

    # the copy is no torch parameter: configure makes it a constant (asserted below)
    cfgs = {f"{family}-reference": make_run(root, f"{family}-reference", model=_frozen_copy_model(root, export),
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
