"""Tensor parallelism of attention whose key/value heads the size does not divide, trained under mpiexec against the
unsplit run of the same export on the same global batch (the ``export_dp`` fixture): the Llama exports with
multi-query attention (1 key/value head, as Falcon and StarCoder have) from TorchScript and from dynamo (default and
optimize=False) at tp 2 and at pp 2 x tp 2 (cut automatically), and the Llama export's 2 key/value heads at tp 4. The
query heads are split; the key/value projections and their RoPE run whole on every rank, each rank's query heads read
the key/value heads they map to, and the key/value weights' gradients are summed over the ranks, so every rank holds
the same key/value weights, bit for bit, and the run ends within the tensor-parallel bound of the Llama exports
(test_llama_parallel_mpi.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.checkpoints.tp import tp_file
from tests.support.parallel_runs import newest
from tests.trainer.exports_checks import assert_equal_to, split_lines, start_layouts, start_values
from tests.trainer.test_llama_parallel_mpi import LLAMA_TP_ATOL, rank_parameter_shapes

pytestmark = pytest.mark.mpi


def rank_params(folder, rank: int, size: int, pp: int = 1) -> dict[str, np.ndarray]:
    """The parameters tensor-parallel rank ``rank`` wrote into a checkpoint (its slices, the replicated ones whole),
    every pipeline stage's."""
    import h5py

    params = {}
    for stage in [(s, pp) for s in range(pp)] if pp > 1 else [None]:
        with h5py.File(folder / tp_file("params", rank, size, stage), "r") as f:
            params.update({str(ds.attrs["name"]): ds[()] for ds in f["parameters"].values()})
    return params


# (export, pp, tp, key/value heads); pp 2 x tp 2 cut automatically (inside the second layer)
CASES = [*[pytest.param(export, pp, 2, 1, id=f"{export.removeprefix('llama-').removesuffix('.onnx')}-{layout}")
           for export in ("llama-mqa.onnx", "llama-mqa-dynamo.onnx", "llama-mqa-dynamo-noopt.onnx")
           for pp, layout in ((1, "tp2"), (2, "pp2xtp2"))],
         pytest.param("llama.onnx", 1, 4, 2, id="gqa-tp4")]


@pytest.mark.parametrize("export_dp,pp,tp,kv_heads", CASES, indirect=["export_dp"])
def test_key_value_heads_replicated_on_every_rank_train_to_the_unsplit_parameters(export_dp, pp, tp, kv_heads):
    export = export_dp.cfg.model.path.name
    # the export's layouts of every case, started together (each trains as soon as it is configured)
    start_layouts(export_dp, {f"pp{p}tp{t}-kv-replicated": (p, t) for e, p, t, _ in (c.values for c in CASES)
                              if e == export})
    run = export_dp.layouts[f"pp{pp}tp{tp}-kv-replicated"]
    lines = split_lines(run.cfg, pp)
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
    held = [rank_params(folder, rank, tp, pp) for rank in range(tp)]
    for layer in range(2):
        for proj in ("k_proj", "v_proj"):
            name = f"model.model.layers.{layer}.self_attn.{proj}.weight"
            assert np.abs(held[0][name] - start[name]).max() > 1e-4, name  # trained, with the whole gradient
            for rank in range(1, tp):  # the sum over the ranks gives every rank the same gradient and update
                assert held[rank][name].tobytes() == held[0][name].tobytes(), (name, rank)
