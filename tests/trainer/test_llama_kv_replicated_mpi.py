"""Tensor parallelism of attention whose key/value heads the size does not divide, trained under mpiexec against the
unsplit run of the same export on the same global batch (the ``export_dp`` fixture): the Llama exports with multi-query
attention (1 key/value head, as Falcon and StarCoder have) from TorchScript and from dynamo at tp 2, and the Llama
export's 2 key/value heads at tp 4. The query heads are split; the key/value projections and their RoPE run whole on
every rank, each rank's query heads read the key/value heads they map to, and the key/value weights' gradients are
summed over the ranks, so every rank holds the same key/value weights, bit for bit, and the run ends within the
tensor-parallel bound of the Llama exports (test_llama_parallel_mpi.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.checkpoints.tp import tp_file
from tests.support.parallel_runs import newest
from tests.trainer.exports_checks import assert_equal_to, layout_of, split_lines, start_values
from tests.trainer.test_llama_parallel_mpi import LLAMA_TP_ATOL, rank_parameter_shapes

pytestmark = pytest.mark.mpi


def rank_params(folder, rank: int, size: int) -> dict[str, np.ndarray]:
    """The parameters tensor-parallel rank ``rank`` wrote into a checkpoint (its slices, the replicated ones whole)."""
    import h5py

    with h5py.File(folder / tp_file("params", rank, size), "r") as f:
        return {str(ds.attrs["name"]): ds[()] for ds in f["parameters"].values()}


# (export, tp, key/value heads)
CASES = [pytest.param("llama-mqa.onnx", 2, 1, id="mqa-tp2"),
         pytest.param("llama-mqa-dynamo.onnx", 2, 1, id="mqa-dynamo-tp2"),
         pytest.param("llama.onnx", 4, 2, id="gqa-tp4")]


@pytest.mark.parametrize("export_dp,tp,kv_heads", CASES, indirect=["export_dp"])
def test_key_value_heads_replicated_on_every_rank_train_to_the_unsplit_parameters(export_dp, tp, kv_heads):
    run = layout_of(export_dp, f"pp1tp{tp}-kv-replicated", 1, tp)
    lines = split_lines(run.cfg, 1)
    assert not [line for line in lines if line.startswith("kept replicated")], lines
    assert len([line for line in lines if "key/value heads replicated" in line]) == 2, lines  # one per layer
    for rank in range(tp):
        shapes = rank_parameter_shapes(run.cfg, rank)
        for layer in range(2):
            attn = f"model.model.layers.{layer}.self_attn"
            # [out, in] Linear weights: 4 / tp query heads of 16 rows, every key/value head whole, and the output
            # projection's input columns that read this rank's query heads
            assert shapes[f"{attn}.q_proj.weight"] == [64 // tp, 64], (rank, shapes)
            assert shapes[f"{attn}.k_proj.weight"] == [16 * kv_heads, 64] == shapes[f"{attn}.v_proj.weight"]
            assert shapes[f"{attn}.o_proj.weight"] == [64, 64 // tp]
    assert_equal_to(export_dp, run.cfg, run.out, atol=LLAMA_TP_ATOL)
    folder, start = newest(run.cfg), start_values(run.cfg)
    held = [rank_params(folder, rank, tp) for rank in range(tp)]
    for layer in range(2):
        for proj in ("k_proj", "v_proj"):
            name = f"model.model.layers.{layer}.self_attn.{proj}.weight"
            assert np.abs(held[0][name] - start[name]).max() > 1e-4, name  # trained, with the whole gradient
            for rank in range(1, tp):  # the sum over the ranks gives every rank the same gradient and update
                assert held[rank][name].tobytes() == held[0][name].tobytes(), (name, rank)
