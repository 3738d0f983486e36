"""BatchNorm under mpiexec, on the committed torch CNN exports (Conv-BN-ReLU x 2; TorchScript, and dynamo
``optimize=False`` for dp 2, pp 2, ZeRO-1 and Adasum) and the MLP with BatchNorm1d (dynamo ``optimize=False``: dp 2,
pp 2, ZeRO-1 and Adasum): running statistics follow torch's rule (float64 reference), every rank holds the same ones
(rank 0's, or their mean), Adasum trains as the mean does, and ``ortflow evaluate`` on a checkpoint equals the eval
loss training recorded for it on 1, 2 and 3 ranks."""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from ortflow.checkpoints import list_complete
from ortflow.dataprep.loader import TrainLoader
from ortflow.export.evaluate import evaluate_checkpoint
from tests.support.exports import export_path
from tests.support.runs import make_run, start_ranks

pytestmark = pytest.mark.mpi

B, K, UPDATES = 2, 2, 4  # n = 2 x 16 x 16 = 512 values per channel in the first BatchNorm, 2 x 8 x 8 = 128 next
TORCH_MOMENTUM, EPS = 0.1, 1e-5
LAYERS = (("features.0", "features.1", 1), ("features.3", "features.4", 2))  # (conv, batchnorm, conv stride)


#: The dynamo exporter's optimize=False CNN (the same torch parameters and BatchNorm buffers, by their torch names).
DYNAMO = "cnn-dynamo-noopt.onnx"
#: The MLP with BatchNorm1d (Linear(8->16), BatchNorm1d(16), ReLU, Linear(16->3)), dynamo's optimize=False export.
MLP = "bnmlp-dynamo-noopt.onnx"
#: Each export's BatchNorm layers, and the input they read.
BATCHNORMS = {"cnn.onnx": ("features.1", "features.4"), DYNAMO: ("features.1", "features.4"), MLP: ("bn",)}
FEATURE = {"cnn.onnx": "pixels", DYNAMO: "pixels", MLP: "features"}


def _data(root, export):
    """256 random 16x16 images with 10 classes for the CNN, 256 random rows of 8 features with 3 classes for the
    MLP."""
    data = root / f"{FEATURE[export]}.npz"
    if not data.exists():
        rng = np.random.default_rng(0)
        if export == MLP:
            features = rng.normal(size=(256, 8)).astype(np.float32)
            labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
            np.savez(data, features=features, labels=labels)
        else:
            pixels = rng.normal(size=(256, 1, 16, 16)).astype(np.float32)
            labels = (pixels.mean(axis=(1, 2, 3)) * 40).astype(np.int64).clip(-5, 4) + 5
            np.savez(data, pixels=pixels, labels=labels)
    return data


def cnn_run(root, name, ranks, checkpoint=None, distributed=None, optimizer=None, export="cnn.onnx",
            model_fields=None, **train):
    """A run of the torch CNN export (TorchScript by default) or of the MLP with BatchNorm1d on its random data."""
    return make_run(root, name, model=export_path(export), model_fields=model_fields,
                    data={"train": [str(_data(root, export))], "eval_fraction": 0.25},
                    distributed={"num_ranks": ranks, **(distributed or {})},
                    train={"batch_size": B, "gradient_accumulation_steps": K, "num_train_steps": K * UPDATES,
                           "evaluation_period": 2, **train},
                    checkpoint=checkpoint or {"period": 1, "max_num_checkpoints": 100},
                    **({"optimizer": optimizer} if optimizer else {}))


def conv(x, w, b, stride):
    """Conv2d, 3x3 kernels, padding 1, in float64."""
    x = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    ho, wo = (x.shape[2] - 3) // stride + 1, (x.shape[3] - 3) // stride + 1
    cols = np.stack([x[:, :, i:i + stride * ho:stride, j:j + stride * wo:stride] for i in range(3) for j in range(3)],
                    axis=2)
    return np.einsum("nckhw,ock->nohw", cols, w.reshape(w.shape[0], w.shape[1], 9)) + b[None, :, None, None]


def batchnorm_inputs(params, batch, export):
    """Each BatchNorm's input in training mode (normalised with the batch's biased statistics), float64."""
    if export == MLP:  # fc1's output
        return [batch["features"].astype(np.float64) @ params["fc1.weight"].T + params["fc1.bias"]]
    x, seen = batch["pixels"].astype(np.float64), []
    for conv_name, bn, stride in LAYERS:
        x = conv(x, params[f"{conv_name}.weight"], params[f"{conv_name}.bias"], stride)
        seen.append(x)
        mean, var = x.mean(axis=(0, 2, 3), keepdims=True), x.var(axis=(0, 2, 3), keepdims=True)
        g, b = params[f"{bn}.weight"][None, :, None, None], params[f"{bn}.bias"][None, :, None, None]
        x = np.maximum((x - mean) / np.sqrt(var + EPS) * g + b, 0)
    return seen


def torch_update(stats, x, ddof=1):
    """torch's BatchNorm running-statistics rule (torch.nn.BatchNorm2d, momentum 0.1):
    running = (1 - momentum) * running + momentum * statistic, with the unbiased batch variance for running_var
    (``ddof=0``: ONNX's BatchNormalization rule, the biased variance), over every axis but the channels'."""
    axes = tuple(a for a in range(x.ndim) if a != 1)
    mean = x.mean(axis=axes)
    var = x.var(axis=axes, ddof=ddof)
    keep = 1 - TORCH_MOMENTUM
    return keep * stats[0] + TORCH_MOMENTUM * mean, keep * stats[1] + TORCH_MOMENTUM * var


def checkpoint_values(path):
    with h5py.File(path / "params.h5", "r") as f:
        return {ds.attrs["name"]: ds[()].astype(np.float64) for ds in f["parameters"].values()}


EVAL_ROWS = 37  # of the 64 eval rows, split unevenly over 2 and 3 ranks


#: The statistics rule of the unsplit 2-rank run the ZeRO-1 runs end at.
AVERAGED = {"batchnorm_sync": "average", "batchnorm_variance": "unbiased"}


def _two_ranks(sync, variance):
    return f"dp2-{sync}-{variance}", (2, {"batchnorm_sync": sync, "batchnorm_variance": variance})


#: The module's finished runs, by name: (ranks, settings). They evaluate the first EVAL_ROWS rows, so that each serves
#: the statistics, evaluate and layout tests alike: 1 rank (averaged statistics), 2 ranks (each sync and variance
#: rule, ZeRO-1 and Adasum), 3 ranks, pp 2 and pp 2 x dp 2; the dynamo export's (``dynamo-``) 1 rank, 2 ranks (ZeRO-1
#: and Adasum too) and pp 2; the MLP's (``mlp-``) 1 rank, 2 ranks (ZeRO-1 and Adasum too) and pp 2 (the automatic
#: cut, fc1's output, puts the BatchNorm in the second stage; the cut by hand after the ReLU, in the first).
RUNS = dict([_two_ranks("broadcast", "unbiased"), _two_ranks("average", "unbiased"), _two_ranks("broadcast", "biased"),
             ("dp1", (1, {"batchnorm_sync": "average"})), ("dp3", (3, {})),
             ("dp2-zero1", (2, {"distributed": {"zero_stage": 1}, **AVERAGED})),
             ("dynamo-dp2-zero1", (2, {"distributed": {"zero_stage": 1}, **AVERAGED, "export": DYNAMO})),
             ("dp2-adasum", (2, {"distributed": {"enable_adasum": True}, **AVERAGED})),
             ("dynamo-dp2-adasum", (2, {"distributed": {"enable_adasum": True}, **AVERAGED, "export": DYNAMO})),
             ("pp2xdp1", (2, {"distributed": {"pipeline_parallel_size": 2}, "batchnorm_sync": "average"})),
             ("pp2xdp2", (4, {"distributed": {"pipeline_parallel_size": 2}, "batchnorm_sync": "average"})),
             ("dynamo-dp1", (1, {"batchnorm_sync": "average", "export": DYNAMO})),
             ("dynamo-dp2-average-unbiased", (2, {"batchnorm_sync": "average", "batchnorm_variance": "unbiased",
                                                  "export": DYNAMO})),
             ("dynamo-pp2xdp1", (2, {"distributed": {"pipeline_parallel_size": 2}, "batchnorm_sync": "average",
                                     "export": DYNAMO})),
             ("mlp-dp1", (1, {"batchnorm_sync": "average", "export": MLP})),
             ("mlp-dp2-average-unbiased", (2, {**AVERAGED, "export": MLP})),
             ("mlp-dp2-zero1", (2, {"distributed": {"zero_stage": 1}, **AVERAGED, "export": MLP})),
             ("mlp-dp2-adasum", (2, {"distributed": {"enable_adasum": True}, **AVERAGED, "export": MLP})),
             ("mlp-pp2xdp1", (2, {"distributed": {"pipeline_parallel_size": 2}, "batchnorm_sync": "average",
                                  "export": MLP})),
             ("mlp-pp2xdp1-relu", (2, {"distributed": {"pipeline_parallel_size": 2}, "batchnorm_sync": "average",
                                       "export": MLP, "model_fields": {"pipeline_cuts": ["relu"]}}))])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(name)``: the finished run of that name of :data:`RUNS`, its config and output. The first test that
    asks configures them all, each starting to train as soon as it is configured (independent jobs, side by side:
    no assertion depends on their order or speed)."""
    root, started = tmp_path_factory.mktemp("cnn"), {}

    def get(name):
        if not started:
            for run, (ranks, settings) in RUNS.items():
                cfg = cnn_run(root, run, ranks, max_eval_rows=EVAL_ROWS, **settings)
                started[run] = cfg, start_ranks(cfg, timeout=300)
        cfg, job = started[name]
        out = job.result()
        assert out.returncode == 0, out.stdout[-3000:]
        return cfg, out

    return get


def _prefix(export):
    return {DYNAMO: "dynamo-", MLP: "mlp-"}.get(export, "")


def two_ranks(trained, sync="average", variance="unbiased", export="cnn.onnx", exchange=""):
    """The 2-rank run of the export with this BatchNorm sync and variance rule (``exchange`` ``adasum``: the Adasum
    run, averaged unbiased statistics)."""
    return trained(f"{_prefix(export)}dp2-{exchange or f'{sync}-{variance}'}")


def one_rank(trained, export="cnn.onnx"):
    """The export's 1-rank run (averaged statistics: the unsplit reference of the pp 2 run, as the 2-rank averaged run
    is of pp 2 x dp 2)."""
    return trained(f"{_prefix(export)}dp1")


@pytest.mark.parametrize(("export", "sync", "variance", "exchange"),
                         [("cnn.onnx", "broadcast", "unbiased", ""), ("cnn.onnx", "average", "unbiased", ""),
                          ("cnn.onnx", "broadcast", "biased", ""), (DYNAMO, "average", "unbiased", ""),
                          ("cnn.onnx", "average", "unbiased", "adasum"), (DYNAMO, "average", "unbiased", "adasum"),
                          (MLP, "average", "unbiased", ""), (MLP, "average", "unbiased", "adasum")])
def test_running_statistics_equal_a_float64_reference_of_torch_on_two_ranks(trained, export, sync, variance, exchange):
    """dp 2 (each rank's BatchNorms normalise by its own micro-batches, so dp 2 differs from one rank by design): the
    running statistics after every update equal torch's rule applied to each rank's batches, synced as asked; with
    Adasum too, which combines the ranks' weight updates and leaves the statistics, which no optimizer updates, to
    that sync."""
    cfg, _ = two_ranks(trained, sync, variance, export, exchange)
    ddof = 1 if variance == "unbiased" else 0
    saved = {info.step: checkpoint_values(info.path) for info in list_complete(cfg.checkpoints_dir)}
    assert sorted(saved) == list(range(1, UPDATES + 1))
    params = {t.name: numpy_helper.to_array(t).astype(np.float64)
              for t in onnx.load(str(export_path(export))).graph.initializer}
    bns = BATCHNORMS[export]
    stats = {bn: (params[f"{bn}.running_mean"], params[f"{bn}.running_var"]) for bn in bns}
    batches = [TrainLoader(cfg.data_dir, B, r, 2, prefetch=0).iter_from(0) for r in range(2)]
    checked = 0
    for step in range(1, UPDATES + 1):
        per_rank = []
        for it in batches:  # each rank updates the common statistics with its own K micro-batches
            mine = dict(stats)
            for _ in range(K):
                inputs = batchnorm_inputs(params, next(it), export)
                mine = {bn: torch_update(mine[bn], x, ddof) for bn, x in zip(bns, inputs, strict=True)}
            per_rank.append(mine)
        if sync == "broadcast":
            stats = per_rank[0]
        else:
            stats = {bn: tuple((a + b) / 2 for a, b in zip(per_rank[0][bn], per_rank[1][bn], strict=True))
                     for bn in stats}
        params = saved[step]  # the next update's forward uses the parameters this update wrote
        for bn in bns:
            # float32 rounding: the engine's activations and sums are float32 (relative error ~1e-6); the biased
            # (ONNX) rule is 1/(n-1) = 2e-3 .. 8e-3 of an update's increment away, above 1e-4 after one update.
            np.testing.assert_allclose(params[f"{bn}.running_mean"], stats[bn][0], rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(params[f"{bn}.running_var"], stats[bn][1], rtol=2e-5, atol=1e-6)
            checked += 1
    assert checked == len(bns) * UPDATES


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_evaluate_equals_the_recorded_eval_loss(trained, ranks):
    cfg, _ = {1: one_rank, 2: two_ranks}.get(ranks, lambda t: t("dp3"))(trained)
    compared = 0
    for info in list_complete(cfg.checkpoints_dir):
        recorded = json.loads((info.path / "meta.json").read_text())["eval_loss"]
        if recorded is None:
            continue  # no eval at this step
        result = evaluate_checkpoint(cfg.output_dir, str(info.step))
        assert result.num_rows == EVAL_ROWS
        assert result.loss == pytest.approx(recorded, rel=1e-5), info.step
        compared += 1
    assert compared == 2  # the evals after updates 2 and 4


# The killed runs evaluate between their checkpoints (eval must leave the weights and running statistics as they are);
# a few eval batches show that as well as the whole split.
KILLED_EVAL_ROWS = 8


def test_a_killed_batchnorm_run_resumes_bitwise(tmp_path):
    from tests.support.runs import kill_and_resume

    settings = dict(batchnorm_sync="average", num_train_steps=K * 80, evaluation_period=7,
                    max_eval_rows=KILLED_EVAL_ROWS, checkpoint={"period": 10, "max_num_checkpoints": 3})
    steady, killed = cnn_run(tmp_path, "steady", 2, **settings), cnn_run(tmp_path, "killed", 2, **settings)
    kill_and_resume(killed, min_step=30, end_step=80, timeout=300, beside=steady)
    a = checkpoint_values(list_complete(steady.checkpoints_dir)[-1].path)
    b = checkpoint_values(list_complete(killed.checkpoints_dir)[-1].path)
    assert a.keys() == b.keys() and any("running_var" in n for n in a)
    for name in a:  # weights and running statistics alike
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize(("export", "layout"), [("cnn.onnx", "pp2xdp1"), ("cnn.onnx", "pp2xdp2"), (DYNAMO, "pp2xdp1"),
                                               ("cnn.onnx", "dp2-zero1"), (DYNAMO, "dp2-zero1"), (MLP, "pp2xdp1"),
                                               (MLP, "pp2xdp1-relu"), (MLP, "dp2-zero1")],
                         ids=["pp2", "pp2xdp2", "dynamo-noopt-pp2", "zero1", "dynamo-noopt-zero1", "mlp-pp2",
                              "mlp-pp2-cut-after-batchnorm", "mlp-zero1"])
def test_pipeline_stages_and_zero1_train_to_the_unsplit_weights_and_running_statistics(trained, export, layout):
    """The CNN cut into two pipeline stages (a BatchNorm on each side of the cut), the MLP in two (its BatchNorm in the
    second stage, or by a cut after its ReLU in the first), or either on 2 ranks with ZeRO-1, ends every checkpoint
    where the unsplit run on as many data-parallel ranks (averaged statistics) does: weights, running statistics
    (averaged over the replicas of each stage), losses and eval losses. The first stage's forward passes
    normalise by the micro-batch, as its training call does; its eval passes by the running statistics. Each ZeRO-1
    rank updates its shard of the parameters; the running statistics, which no optimizer updates, are synced as at
    dp 2."""
    from ortflow.checkpoints.h5state import read_params
    from tests.support.parallel_runs import losses

    unsplit, out_unsplit = (one_rank if layout.startswith("pp2xdp1") else two_ranks)(trained, export=export)
    staged, out_staged = trained(f"{_prefix(export)}{layout}")
    if layout.endswith("-relu"):  # the cut by hand, the BatchNorm before it
        assert json.loads((staged.output_dir / "configure.json").read_text())["pipeline_cuts"] == ["relu"]
    outs = [out_unsplit, out_staged]
    steps = [[info.step for info in list_complete(cfg.checkpoints_dir)] for cfg in (unsplit, staged)]
    assert steps[0] == steps[1] and len(steps[0]) == UPDATES
    worst = 0.0
    for a, b in zip(list_complete(unsplit.checkpoints_dir), list_complete(staged.checkpoints_dir), strict=True):
        p, q = read_params(a.path), read_params(b.path)
        assert sorted(p) == sorted(q) and sum("running_mean" in n for n in p) == len(BATCHNORMS[export])
        worst = max(worst, max(float(np.abs(p[n] - q[n]).max()) for n in p))
    if layout == "dp2-zero1":  # each rank updates its shard of the parameters and writes its optimizer state
        files = sorted(f.name for f in list_complete(staged.checkpoints_dir)[-1].path.glob("optimizer*.h5"))
        assert files == [f"optimizer-rank0000{rank}-of-00002.h5" for rank in range(2)], files
    print(f"{export} {layout} vs unsplit: max |difference| over {UPDATES} checkpoints {worst:.3g}")
    assert worst < 1e-6  # the same kernels on the same micro-batches (0 measured); an update moves weights by ~1e-2
    np.testing.assert_allclose(losses(outs[1].stdout), losses(outs[0].stdout), rtol=1e-6)
    evals = [[float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", out.stdout)] for out in outs]
    assert len(evals[0]) == 2
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-6)
    _assert_exports_agree(unsplit, staged, export)


@pytest.mark.parametrize("export", ["cnn.onnx", DYNAMO, MLP], ids=["torchscript", "dynamo-noopt", "mlp"])
def test_adasum_trains_as_the_mean_does(trained, export):
    """On 2 ranks with Adasum (averaged statistics), against the same export's 2-rank run that averages the ranks'
    gradients: each rank keeps its own optimizer state, the first update's loss is the mean run's (same start, same
    batches), and Adasum's step points the way the mean's does and is about as long."""
    from ortflow.checkpoints.h5state import read_params
    from tests.support.parallel_runs import losses
    from tests.trainer.exports_checks import assert_adasum_steps_as_the_mean

    mean_cfg, mean_out = two_ranks(trained, export=export)
    ada_cfg, ada_out = two_ranks(trained, export=export, exchange="adasum")
    newest = list_complete(ada_cfg.checkpoints_dir)[-1].path
    files = sorted(f.name for f in newest.glob("optimizer*.h5"))
    assert files == [f"optimizer-rank0000{rank}-of-00002.h5" for rank in range(2)], files
    adasum, mean = losses(ada_out.stdout), losses(mean_out.stdout)
    assert len(adasum) == UPDATES and np.isfinite(adasum).all() and adasum[0] == pytest.approx(mean[0], rel=1e-6)
    evals = [float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", ada_out.stdout)]
    assert len(evals) == 2 and np.isfinite(evals).all()
    trainable = json.loads((ada_cfg.output_dir / "configure.json").read_text())["trainable"]
    assert not [n for n in trainable if "running_" in n]  # the statistics are not Adasum's (the test above)
    assert_adasum_steps_as_the_mean(export, ada_cfg, read_params(newest),
                                    read_params(list_complete(mean_cfg.checkpoints_dir)[-1].path), trainable)


def _assert_exports_agree(unsplit, staged, export):
    """The inference models exported from the two runs carry the same running statistics and compute the same logits
    (the statistics of a stage come from its checkpoint files)."""
    import onnxruntime as ort

    from ortflow.export.model import export_model

    shape = (5, 8) if export == MLP else (5, 1, 16, 16)
    feeds = {FEATURE[export]: np.random.default_rng(3).normal(size=shape).astype(np.float32)}
    logits = []
    for cfg in (unsplit, staged):
        out = cfg.output_dir / "exported.onnx"
        export_model(cfg.output_dir, out, config=cfg)
        logits.append(ort.InferenceSession(str(out)).run(["logits"], feeds)[0])
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-6, atol=1e-6)


def test_a_killed_two_stage_batchnorm_run_resumes_bitwise(tmp_path):
    """Each stage's checkpoint files hold its running statistics; a killed pp 2 run resumes to the same weights and
    statistics as an uninterrupted one, bit for bit."""
    from ortflow.checkpoints.h5state import read_params
    from tests.support.runs import kill_and_resume

    settings = dict(distributed={"pipeline_parallel_size": 2}, num_train_steps=K * 80, evaluation_period=7,
                    max_eval_rows=KILLED_EVAL_ROWS, checkpoint={"period": 10, "max_num_checkpoints": 3})
    steady, killed = cnn_run(tmp_path, "steady", 2, **settings), cnn_run(tmp_path, "killed", 2, **settings)
    kill_and_resume(killed, min_step=30, end_step=80, timeout=300, beside=steady)
    a = read_params(list_complete(steady.checkpoints_dir)[-1].path)
    b = read_params(list_complete(killed.checkpoints_dir)[-1].path)
    assert a.keys() == b.keys() and sum("running_var" in n for n in a) == 2
    for name in a:
        assert np.array_equal(a[name], b[name]), name
