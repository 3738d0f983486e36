"""Every layout has every feature: dp 2, pp 2, tp 2, pp 2 x tp 2 and dp 2 x tp 2 under mpiexec, with the per-op
profiler, the step-time breakdown and TensorBoard histograms on; profiling leaves the training bitwise unchanged; and
batch dims follow the model in every layout: an export with a fixed (traced) batch, which configure makes symbolic,
trains and evaluates at another batch size, with an eval split that is not a multiple of it, split in pipeline stages,
tensor-parallel pieces and both, and ends where the unsplit run ends. Each layout trains twice (without and with the
profiler), once for all of these assertions."""

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
from ortflow.trainer.profiling import top_operators
from ortflow.trainer.timing import PHASES, read_timing
from tests.support.parallel_runs import newest
from tests.support.runs import make_run, start_ranks

pytestmark = pytest.mark.mpi

LAYOUTS = {
    "dp2": {"num_ranks": 2},
    "pp2": {"num_ranks": 2, "pipeline_parallel_size": 2},
    "tp2": {"num_ranks": 2, "horizontal_parallel_size": 2},
    "pp2tp2": {"num_ranks": 4, "pipeline_parallel_size": 2, "horizontal_parallel_size": 2},
    "dp2tp2": {"num_ranks": 4, "horizontal_parallel_size": 2},  # replicas of a split model: replica 0's gather
}
# The layouts of one replica: they train on the unsplit run's global batch.
SPLIT = {"pp2": "pp2", "tp2": "tp2", "pp2xtp2": "pp2tp2"}
SEQ, TRACED, BATCH = 8, 2, 4
UPDATES = 4  # of 2 micro-batches of BATCH windows, a report after every update, an eval after updates 2 and 4
TRAIN = {"batch_size": BATCH, "gradient_accumulation_steps": 2, "num_train_steps": 2 * UPDATES,
         "evaluation_period": 2, "display_loss_steps": 1}
PROFILED = [2, 3]


def fixed_batch_gpt(path):
    """ortflow's GPT as ``torch.onnx.export`` writes it without dynamic axes: batch fixed at the traced size 2."""
    build_gpt(path, vocab_size=256, seq_len=SEQ, d_model=32, num_layers=2, num_heads=4)
    model = onnx.load(str(path))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = TRACED
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = TRACED * SEQ
    onnx.save(model, str(path))


def layout_run(root, name, distributed: dict, **sections):
    """A run of the fixed-batch GPT on its own text (the eval split's size must not depend on anything else)."""
    model = root / "fixed.onnx"
    if not model.exists():
        fixed_batch_gpt(model)
    corpus = root / "corpus.txt"
    if not corpus.exists():
        # 904 windows: 45 eval rows (a short last eval batch of 1), enough training rows for every layout's updates
        corpus.write_text("".join(f"line {i}: the batch follows the model in every layout.\n" for i in range(150)))
    data = {"train": [str(corpus)], "format": "text", "text": {"seq_len": SEQ}, "eval_fraction": 0.05}
    train = {**TRAIN, **sections.pop("train", {})}
    return make_run(root, name, model=model, data=data, train=train, optimizer={"learning_rate": 1e-3},
                    distributed=distributed, **sections)


def _events(cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg.tensorboard_dir), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def unsplit(root):
    """The one-rank run on every split layout's global batch; it trains while the first layout's runs configure."""
    cfg = layout_run(root, "unsplit", {"num_ranks": 1})
    return cfg, start_ranks(cfg, timeout=600)


@pytest.fixture(scope="module")
def trained(unsplit):
    """Each layout's two runs and their jobs, by layout name (:func:`runs_of`); the unsplit run starts first."""
    return {}


def runs_of(root, trained: dict, name: str):
    """The layout's plain run and its profiled run (timing, per-op profile, histograms of every parameter), trained
    once for every test that asks: (plain, traced, plain's output). The first test that asks configures both runs of
    every layout, each starting to train as soon as it is configured (independent jobs, side by side: no assertion
    depends on their order or speed)."""
    if not trained:
        for layout, dist in LAYOUTS.items():
            plain = layout_run(root, f"{layout}-plain", dist)
            trained[layout] = [(plain, start_ranks(plain, timeout=400))]
            traced = layout_run(root, f"{layout}-traced", dist, train={"profile_steps": PROFILED},
                                tensorboard={"histogram_names": ["*"]})
            trained[layout].append((traced, start_ranks(traced, timeout=400)))
    (plain, plain_job), (traced, traced_job) = trained[name]
    outs = [plain_job.result(), traced_job.result()]
    for out in outs:
        assert out.returncode == 0, out.stdout[-3000:]
    return plain, traced, outs[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_writes_timing_profile_and_histograms_and_trains_as_without_them(root, trained, name):
    dist = LAYOUTS[name]
    plain, traced, _ = runs_of(root, trained, name)

    # The step-time breakdown: timing.json and the time/* scalars of every report.
    timing = read_timing(traced.output_dir)
    assert set(timing["shares"]) == set(PHASES) and abs(sum(timing["shares"].values()) - 1) < 1e-9
    seconds = timing["seconds"]
    assert seconds["forward_backward"] > 0 and seconds["update"] > 0 and seconds["eval"] > 0
    assert seconds["checkpoint"] > 0 and len(timing["windows"]) == UPDATES
    events = _events(traced)
    shares = {p: [e.value for e in events.Scalars(f"time/{p}")] for p in PHASES}
    assert all(len(shares[p]) == UPDATES for p in PHASES)
    for i in range(UPDATES):
        assert abs(sum(shares[p][i] for p in PHASES) - 1) < 1e-5

    # The per-op profile: a trace from every rank, rank 0's table, the training calls of the profiled updates.
    folder = traced.output_dir / "profile"
    for rank in range(dist["num_ranks"]):
        rows = top_operators(folder / f"rank-{rank}.json")
        assert rows and sum(r["calls"] for r in rows) > 0, rank
        meta = json.loads((folder / f"rank-{rank}.meta.json").read_text())
        assert meta["steps"] == PROFILED and meta["calls"] >= 2 * 2, meta  # 2 updates x 2 micro-batches at least
    assert "| op type | calls |" in (folder / "top_ops.md").read_text()
    assert not list(folder.glob(".rank-*"))  # every part's trace was merged into its rank's file

    # Histograms of the whole model (stages gathered, slices merged) on rank 0, at every report.
    final = read_params(newest(traced))  # the last update's parameters, every stage's slices merged
    tags = set(events.Tags()["histograms"])
    assert tags == {f"params/{n}" for n in final}
    for param, value in final.items():
        steps = events.Histograms(f"params/{param}")
        assert [h.step for h in steps] == list(range(1, UPDATES + 1)), param
        last = steps[-1].histogram_value
        assert last.num == value.size and last.min == float(value.min()) and last.max == float(value.max()), param
        assert last.sum == pytest.approx(float(value.sum()), rel=1e-5, abs=1e-6), param

    # The profiling sessions share the parameters and hand their gradients over: the same bits as without them.
    reference = read_params(newest(plain))
    assert sorted(reference) == sorted(final)
    for param, value in reference.items():
        np.testing.assert_array_equal(final[param], value, err_msg=param)


def eval_losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", output)]


@pytest.mark.parametrize("layout", list(SPLIT))
def test_any_batch_size_and_a_short_last_eval_batch_work_in_every_layout(root, unsplit, trained, layout):
    ref_cfg, ref_job = unsplit
    assert read_manifest(ref_cfg.data_dir).num_rows("eval") % BATCH != 0  # the last eval batch is short
    batch = json.loads((ref_cfg.output_dir / "configure.json").read_text())["batch"]
    assert batch["fixed_batch"] == TRACED and batch["symbolic"]  # configure made the traced batch symbolic
    cfg, _, out = runs_of(root, trained, SPLIT[layout])
    ref_out = ref_job.result()
    assert ref_out.returncode == 0, ref_out.stdout[-3000:]
    assert [c.step for c in list_complete(cfg.checkpoints_dir)][-1] == UPDATES
    np.testing.assert_allclose(eval_losses(out.stdout), eval_losses(ref_out.stdout), rtol=1e-5)
    assert len(eval_losses(out.stdout)) == 2
    p1, p2 = read_params(newest(ref_cfg)), read_params(newest(cfg))
    # pp alone computes the unsplit ops (fp32 rounding of the regrouped sums only); tensor pieces add row-parallel
    # partial sums, a few ulps per gradient (measured after 4 updates: tp 2 3.7e-6, pp 2 x tp 2 2.0e-6).
    atol = 1e-6 if "tp" not in layout else 1e-5
    assert max(float(np.abs(p1[n] - p2[n]).max()) for n in p1) < atol
