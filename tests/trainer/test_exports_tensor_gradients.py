"""Tensor pieces compute the unsplit model's gradients: one micro-batch through the artifacts configure builds for
``tp`` 2 and for one rank, the ranks simulated in one process (tests/support/tensor_sim.py), compared parameter by
parameter on the real exports."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.support.tensor_sim import piece_gradients, whole_gradients

from .exports_runs import SEQ, bert_data, bert_run, gpt2_run

# The pieces add the row-parallel partial sums over the ranks, each rounded in halves: every gradient measured within
# 4.8e-7 of its parameter's largest unsplit entry (BERT tp 2). A wrong gradient is off by a whole term: a tensor of
# slices summed over the ranks differed by 1.0 of it.
RTOL = 1e-5
# The attention key biases' exact gradient is zero (softmax ignores them); the engine's is rounding noise of 1e-11.
NOISE = 1e-9


def _batch(name: str, root) -> dict[str, np.ndarray]:
    if name == "bert":
        table = pq.read_table(bert_data(root)).slice(0, 2)
        return {c: np.array(table[c].to_pylist(), np.int64) for c in ("input_ids", "attention_mask", "labels")}
    ids = np.random.default_rng(0).integers(0, 512, (2, SEQ))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_tensor_pieces_compute_every_parameters_unsplit_gradient(tmp_path, name):
    make = bert_run if name == "bert" else gpt2_run
    whole_cfg = make(tmp_path, "dp", distributed={"num_ranks": 1})
    split_cfg = make(tmp_path, "tp2", distributed={"num_ranks": 2, "horizontal_parallel_size": 2})
    batch = _batch(name, tmp_path)

    loss, whole = whole_gradients(whole_cfg.artifacts_dir, batch)
    losses, split, replicated = piece_gradients(split_cfg.artifacts_dir, batch)

    assert losses == [losses[0]] * 2
    assert losses[0] == pytest.approx(loss, rel=1e-6)
    assert sorted(split) == sorted(whole)
    differ = {}
    for param, g in whole.items():
        diff = float(np.abs(split[param] - g).max())
        if diff > RTOL * float(np.abs(g).max()) + NOISE:
            differ[param] = f"max |diff| {diff:.3g}, |unsplit| {np.linalg.norm(g):.4g}, " \
                            f"|split| {np.linalg.norm(split[param]):.4g}"
    assert not differ, f"gradients that differ from the unsplit model's: {differ}"
    for param, per_rank in replicated.items():  # the ranks keep bitwise the same replicated parameters
        assert all(np.array_equal(per_rank[0], g) for g in per_rank[1:]), param
