"""ZeRO-1 and Adasum over the replicas of a model split both ways, on real exports: the Llama exports from TorchScript
(stages cut by hand between its two layers) and from dynamo, torch's default exporter (cut automatically), each
trained at dp 2 x pp 2 x tp 2 under ``mpiexec -n 8`` (attention split by heads) with each exchange, on the unsplit
runs' global batch. ZeRO-1 ends where the unsplit run ends (ZeRO-1 computes the mean); Adasum ends where Adasum over
unsplit replicas (dp 2) ends; each replica of each (stage, slice) writes its own optimizer file. The same exchanges over
pipeline stages alone, tensor pieces alone, with merged optimizer state and a killed run's bitwise resume:
test_pipeline_exchanges_mpi.py and test_tensor_exchanges_mpi.py (the bundled GPT)."""

from __future__ import annotations

import numpy as np
import pytest

from ortflow.checkpoints.h5state import read_params
from ortflow.checkpoints.tp import tp_shard_file
from tests.support.parallel_runs import losses, newest
from tests.trainer.exports_checks import (
    DP2_TRAIN,
    EXCHANGES,
    assert_equal_to,
    exchange_runs,
    export_run,
    train,
)
from tests.trainer.test_llama_parallel_mpi import BLOCK_0_OUT, LLAMA_TP_ATOL, assert_attention_split_by_heads

pytestmark = pytest.mark.mpi

GRID = {"num_ranks": 8, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2}
#: Each export's extra sections: the TorchScript export's stages cut between its layers (its automatic cut is inside
#: the second layer, as the dynamo export's is).
EXPORTS = {"llama.onnx": {"model_fields": {"pipeline_cuts": [BLOCK_0_OUT]}}, "llama-dynamo.onnx": {}}


@pytest.mark.parametrize("export_dp", list(EXPORTS), indirect=True)
def test_llama_exports_train_with_zero1_and_adasum_over_pipeline_x_tensor_parallel_replicas(export_dp):
    ref, export = export_dp.cfg, export_dp.cfg.model.path.name
    split = {name: export_run(ref.output_dir.parent, f"dp2pp2tp2-{name}", export, train=DP2_TRAIN,
                              distributed={**GRID, **fields}, **EXPORTS[export])
             for name, fields in EXCHANGES.items()}
    unsplit = exchange_runs(export_dp, ("adasum",))["adasum"]  # Adasum over 2 unsplit replicas
    outs = dict(zip(split, train(*split.values()), strict=True))
    for name, cfg in split.items():
        assert_attention_split_by_heads(cfg, pp=2)
        files = sorted(f.name for f in newest(cfg).glob("optimizer*.h5"))
        assert files == sorted(tp_shard_file(t, 2, (s, 2), r, 2) for s in range(2) for t in range(2)
                               for r in range(2)), (name, files)
    # ZeRO-1 is the mean, its optimizer state sharded: the run ends where the unsplit one does (losses, evaluations
    # and parameters), within the tensor split's rounding
    assert_equal_to(export_dp, split["zero1"], outs["zero1"], atol=LLAMA_TP_ATOL)
    # Adasum combines whole tensors (a slice's dot products and norms added over its stage's tensor-parallel ranks):
    # the split run ends where Adasum over unsplit replicas ends. A coefficient of the wrong slice or stage moves the
    # weights by ~lr (1e-3) per update.
    p1, p2 = read_params(newest(unsplit[0])), read_params(newest(split["adasum"]))
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    print(f"{export}: Adasum at dp 2 x pp 2 x tp 2 against dp 2: max |param diff| {worst:.3g}")
    assert worst < LLAMA_TP_ATOL, sorted(((float(np.abs(p1[n] - p2[n]).max()), n) for n in p1), reverse=True)[:5]
    np.testing.assert_allclose(losses(outs["adasum"].stdout), losses(unsplit[1].stdout), rtol=1e-4)
