"""Batch dims follow the model in every layout: an export with a fixed (traced) batch, which configure makes
symbolic, trains and evaluates at another batch size, with an eval split that is not a multiple of it, split in
pipeline stages, tensor-parallel pieces and both; and ends where the unsplit run ends."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

from ortflow.checkpoints import list_complete
from ortflow.checkpoints.h5state import read_params
from ortflow.dataprep.manifest import read_manifest
from ortflow.examples.gpt import build_gpt
from tests.support.parallel_runs import newest
from tests.support.runs import make_run, run_ranks, start_ranks

pytestmark = pytest.mark.mpi

SEQ, TRACED, BATCH = 8, 2, 4
LAYOUTS = {"pp2": (2, 1), "tp2": (1, 2), "pp2xtp2": (2, 2)}


def fixed_batch_gpt(path):
    """ortflow's GPT as ``torch.onnx.export`` writes it without dynamic axes: batch fixed at the traced size 2."""
    build_gpt(path, vocab_size=256, seq_len=SEQ, d_model=32, num_layers=2, num_heads=4)
    model = onnx.load(str(path))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = TRACED
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = TRACED * SEQ
    onnx.save(model, str(path))


def run(root, name, pp, tp):
    model = root / "fixed.onnx"
    if not model.exists():
        fixed_batch_gpt(model)
    corpus = root / "corpus.txt"
    if not corpus.exists():  # its own text: the eval split's size must not depend on anything else
        corpus.write_text("".join(f"line {i}: the batch follows the model in every layout.\n" for i in range(700)))
    data = {"train": [str(corpus)], "format": "text", "text": {"seq_len": SEQ}, "eval_fraction": 0.05}
    train = {"batch_size": BATCH, "num_train_steps": 4, "evaluation_period": 2, "display_loss_steps": 1}
    return make_run(root, name, model=model, data=data, train=train, optimizer={"learning_rate": 1e-3},
                    distributed={"num_ranks": pp * tp, "pipeline_parallel_size": pp,
                                 "horizontal_parallel_size": tp})


def eval_losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", output)]


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    cfg = run(root, "dp", 1, 1)
    return cfg, start_ranks(cfg, timeout=600)  # it trains while the first layout's run configures


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_any_batch_size_and_a_short_last_eval_batch_work_in_every_layout(unsplit, layout):
    ref_cfg, ref_job = unsplit
    assert read_manifest(ref_cfg.data_dir).num_rows("eval") % BATCH != 0  # the last eval batch is short
    batch = json.loads((ref_cfg.output_dir / "configure.json").read_text())["batch"]
    assert batch["fixed_batch"] == TRACED and batch["symbolic"]  # configure made the traced batch symbolic
    cfg = run(ref_cfg.output_dir.parent, layout, *LAYOUTS[layout])
    out, ref_out = run_ranks(cfg, timeout=600), ref_job.result()
    assert out.returncode == 0, out.stdout[-3000:]
    assert ref_out.returncode == 0, ref_out.stdout[-3000:]
    assert [c.step for c in list_complete(cfg.checkpoints_dir)][-1] == 4
    np.testing.assert_allclose(eval_losses(out.stdout), eval_losses(ref_out.stdout), rtol=1e-5)
    assert len(eval_losses(out.stdout)) == 2
    p1, p2 = read_params(newest(ref_cfg)), read_params(newest(cfg))
    # pp alone computes the unsplit ops (fp32 rounding of the regrouped sums only); tensor pieces add row-parallel
    # partial sums, a few ulps per gradient (measured after 4 updates: tp 2 3.7e-6, pp 2 x tp 2 2.0e-6).
    atol = 1e-6 if LAYOUTS[layout][1] == 1 else 1e-5
    assert max(float(np.abs(p1[n] - p2[n]).max()) for n in p1) < atol
