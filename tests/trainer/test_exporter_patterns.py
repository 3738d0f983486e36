"""The committed exports that pin what torch's exporters write where ortflow rewrites or refuses it
(tests/support/exports.py, ``PATTERN_NAMES``), trained on one rank: a fresh tiny GPT-2 with sdpa attention from
TorchScript (equal-valued initializers merged) and from dynamo with ``optimize=False`` (the attention's ``CastLike``),
the CNN from both exporters (BatchNorms kept with ``optimize=False``), and an MLP with BatchNorm1d from dynamo with
``optimize=False`` (trained) and with its defaults (refused: the BatchNorm folded into the Linear before it, as the
CNN's BatchNorms are into its convolutions). The CNN's and the LSTM + GRU classifier's first SGD update, from both
exporters, is compared with torch's gradients."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from ortflow.checkpoints.h5state import read_params
from tests.support.exports import export_path, torch_record
from tests.support.parallel_runs import losses, newest
from tests.support.runs import make_run, run_ranks_together
from tests.trainer.exports_checks import EXPORTER_ATOL
from tests.trainer.exports_runs import gpt2_run

#: The exports trained here, by file name, and the torch family whose record they are checked against.
TRAINED = {"gpt2-sdpa.onnx": "gpt2-sdpa", "gpt2-sdpa-dynamo-noopt.onnx": "gpt2-sdpa",
           "bnmlp-dynamo-noopt.onnx": "bnmlp", "cnn.onnx": "cnn", "cnn-dynamo-noopt.onnx": "cnn"}
#: Updates each run trains (one micro-batch each); lr 1e-3 moves a weight by up to ~1e-3 per update.
UPDATES = 4


def _pixels(root):
    """Random 16x16 images with 10 classes for the CNN."""
    path = root / "pixels.npz"
    if not path.exists():
        rng = np.random.default_rng(0)
        pixels = rng.normal(size=(64, 1, 16, 16)).astype(np.float32)
        np.savez(path, pixels=pixels, labels=rng.integers(0, 10, 64))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each export of :data:`TRAINED` configured and trained for :data:`UPDATES` updates on one rank (the three jobs
    side by side): name -> (config, the job's output)."""
    root = tmp_path_factory.mktemp("patterns")
    one_rank = {"num_train_steps": UPDATES, "gradient_accumulation_steps": 1, "evaluation_period": 0}
    cfgs = {}
    for name in TRAINED:
        stem = name.removesuffix(".onnx")
        if name.startswith("gpt2"):
            cfgs[name] = gpt2_run(root, stem, export=name, train=one_rank)
        elif name.startswith("cnn"):
            cfgs[name] = make_run(root, stem, model=export_path(name), data={"train": [str(_pixels(root))]},
                                  train=one_rank)
        else:
            cfgs[name] = make_run(root, stem, model=export_path(name), train=one_rank)
    outs = run_ranks_together(*cfgs.values())
    return {name: (cfg, out) for (name, cfg), out in zip(cfgs.items(), outs, strict=True)}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_pattern_export_validates_trains_and_writes_the_torch_state_dict(runs, name):
    """validate finds nothing; configure trains exactly the torch parameters under their torch names; one rank trains
    it; ``ortflow export --state-dict`` writes every torch state-dict key with its torch shape and the trained values
    (GPT-2's tied ``lm_head.weight`` too, from the TorchScript run's one table; a BatchNorm's ``num_batches_tracked``,
    which no ONNX graph holds: the micro-batches the rank trained)."""
    from safetensors.numpy import load_file
    from typer.testing import CliRunner

    from ortflow.cli import app
    from ortflow.validate import validate

    cfg, out = runs[name]
    record = torch_record(TRAINED[name])
    other_folder = cfg.output_dir.parent / f"validate-{cfg.output_dir.name}"
    assert validate(cfg.output_dir / "config.yaml", [f"output_dir={other_folder}"]) == []
    info = json.loads((cfg.output_dir / "configure.json").read_text())
    assert sorted(info["trainable"]) == sorted(record["parameters"])
    assert out.returncode == 0, out.stdout[-3000:]
    trained = losses(out.stdout)
    assert len(trained) == UPDATES and all(np.isfinite(trained)), trained

    params = read_params(newest(cfg))
    written_path = cfg.output_dir / "weights.safetensors"
    result = CliRunner().invoke(app, ["export", str(cfg.output_dir), "--state-dict", str(written_path),
                                      "--checkpoint", "latest"])
    assert result.exit_code == 0, result.output
    written = load_file(str(written_path))
    assert sorted(written) == sorted(record["state_dict"])
    tied = {alias: first for first, alias in record["tied"]}
    for key, shape in record["state_dict"].items():
        assert list(written[key].shape) == shape, key
        if key.endswith(".num_batches_tracked"):  # no ONNX graph holds it: the micro-batches the rank trained
            assert written[key].dtype == np.int64 and written[key] == UPDATES, (key, written[key])
            continue
        np.testing.assert_array_equal(written[key], params[tied.get(key, key)], err_msg=key)
    if name == "gpt2-sdpa.onnx":  # TorchScript wrote the tied table once, as transformer.wte.weight
        assert "model.lm_head.weight" not in params
        np.testing.assert_array_equal(written["model.lm_head.weight"], written["model.transformer.wte.weight"])
    if name.startswith("bnmlp"):  # the running statistics the engine updated, as the checkpoint holds them
        assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= set(written)
    if name.startswith("cnn"):
        assert {f"features.{k}.{s}" for k in (1, 4) for s in ("running_mean", "running_var", "num_batches_tracked")} \
            <= set(written)


def test_cnn_dynamo_noopt_export_trains_as_its_torchscript_twin(runs):
    """The CNN's dynamo export with optimize=False and its TorchScript export, trained alike on one rank, end with the
    same weights and running statistics, and the same losses."""
    script = read_params(newest(runs["cnn.onnx"][0]))
    dynamo = read_params(newest(runs["cnn-dynamo-noopt.onnx"][0]))
    assert sorted(script) == sorted(dynamo) and sum("running_var" in n for n in script) == 2
    worst = max(float(np.abs(value - dynamo[name]).max()) for name, value in script.items())
    print(f"cnn: dynamo optimize=False vs TorchScript after {UPDATES} updates on one rank: max |diff| {worst:.3g}")
    for name, value in script.items():
        np.testing.assert_allclose(value, dynamo[name], rtol=0, atol=EXPORTER_ATOL, err_msg=name)
    assert losses(runs["cnn.onnx"][1].stdout) == pytest.approx(losses(runs["cnn-dynamo-noopt.onnx"][1].stdout),
                                                               rel=1e-5)


def test_sdpa_castlike_is_trained_as_cast(runs):
    """The dynamo optimize=False export's six ``CastLike`` nodes (sdpa's scale, cast like the query) are ``Cast``
    nodes in what the engine trains: it has no CastLike gradient, so configure would otherwise refuse every parameter
    before the attention."""
    cfg, _ = runs["gpt2-sdpa-dynamo-noopt.onnx"]
    castlikes = [n.name for n in onnx.load(str(export_path("gpt2-sdpa-dynamo-noopt.onnx"))).graph.node
                 if n.op_type == "CastLike"]
    assert len(castlikes) == 6
    info = json.loads((cfg.output_dir / "configure.json").read_text())
    changes = {r["pass"]: r["changes"] for r in info["graph_rewrites"]}["castlike_to_cast"]
    assert sorted(c.split("'")[1] for c in changes) == sorted(castlikes)
    training = onnx.load(str(cfg.artifacts_dir / "training_model.onnx"), load_external_data=False)
    assert "CastLike" not in {n.op_type for n in training.graph.node}


def test_torchscript_merged_parameters_train_apart_as_in_torch(runs):
    """TorchScript merged the fresh GPT-2's equal parameters (unit LayerNorm weights, zero biases): each trains apart
    under its own name, and ends where the dynamo optimize=False export of the same model, which keeps every torch
    parameter apart, ends it; the parameters the exporter merged end with different values there."""
    model = onnx.load(str(export_path("gpt2-sdpa.onnx")))
    merged = [(n.input[0], n.output[0]) for n in model.graph.node if n.op_type == "Identity"
              and n.input[0] in {t.name for t in model.graph.initializer}]
    assert len(merged) == 6, merged
    script = read_params(newest(runs["gpt2-sdpa.onnx"][0]))
    dynamo = read_params(newest(runs["gpt2-sdpa-dynamo-noopt.onnx"][0]))
    assert sorted(script) == sorted(dynamo)
    for name, value in script.items():  # measured: bit for bit
        np.testing.assert_allclose(value, dynamo[name], rtol=0, atol=EXPORTER_ATOL, err_msg=name)
    for kept, other in merged:
        # torch's gradients of the two differ, so the dynamo run moves them apart by several updates' steps
        assert np.abs(dynamo[kept] - dynamo[other]).max() > 2e-3, (kept, other)
        assert np.abs(script[kept] - script[other]).max() > 2e-3, (kept, other)
    assert losses(runs["gpt2-sdpa.onnx"][1].stdout) == pytest.approx(
        losses(runs["gpt2-sdpa-dynamo-noopt.onnx"][1].stdout), rel=1e-5)


#: The dynamo exports whose default optimisation folded eval-mode BatchNorms into the layer before them: the feature
#: the model reads, its shape, and what validate names.
FOLDED = {"bnmlp-dynamo.onnx": ("features", (8,), ["BatchNorm 'bn' was folded into the Gemm"]),
          "cnn-dynamo.onnx": ("pixels", (1, 16, 16), [f"BatchNorm 'features.{k}' was folded into the Conv"
                                                      for k in (1, 4)])}


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_batchnorm_export_is_refused_at_validate_and_configure(tmp_path, name):
    """The dynamo exporter's default optimisation folded the eval-mode BatchNorms into the Gemm or Conv before them:
    validate reports it as one problem naming each BatchNorm and ``optimize=False``, and configure refuses it before
    building anything."""
    import yaml

    from ortflow.config import ConfigError, config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.validate import validate

    feature, shape, folded = FOLDED[name]
    np.savez(tmp_path / "data.npz", **{feature: np.ones((64, *shape), np.float32)}, labels=np.zeros(64, np.int64))
    raw = {"name": "folded", "output_dir": str(tmp_path / "run"),
           "model": {"path": str(export_path(name))}, "data": {"train": [str(tmp_path / "data.npz")]},
           "train": {"batch_size": 4, "num_train_steps": 2}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    (problem,) = validate(tmp_path / "run.yaml")
    assert all(what in problem for what in folded) and "optimize=False" in problem, problem
    assert "\n" not in problem
    with pytest.raises(ConfigError, match=folded[0]) as err:
        configure(config_from_dict(raw))
    assert "optimize=False" in str(err.value)
    assert not (tmp_path / "run" / "artifacts").exists()


#: The exports whose first update is compared with torch's gradients (``<family>.grads.safetensors``: a batch and
#: torch's gradients of the mean cross-entropy on it, the model in training mode; Qwen2's over every token, T5's over
#: every decoder token).
GRADIENTS = ("cnn.onnx", "cnn-dynamo-noopt.onnx", "rnn.onnx", "rnn-dynamo-noopt.onnx", "qwen2.onnx",
             "qwen2-dynamo.onnx", "phi3.onnx", "phi3-dynamo.onnx", "phi3-dynamo-noopt.onnx",
             "gemma.onnx", "gemma-dynamo-noopt.onnx", "neox.onnx", "neox-dynamo.onnx", "neox-dynamo-noopt.onnx",
             "t5.onnx", "t5-dynamo.onnx", "t5-dynamo-noopt.onnx")
#: One SGD step of lr 1 moves each weight by its gradient: measured within 1.5e-7 of torch's on the CNN, 3e-8 on the
#: LSTM + GRU, 1.2e-7 on Qwen2, on Phi-3 and on T5 (fp32 sums in other orders) where gradients reach 1e-1 (Qwen2's key
#: biases 4e-4: RoPE rotates them by the key's position, so softmax does not cancel them; T5's relative position
#: bias tables 1e-2, read by every layer of their stack, broadcast over the batch); a wrong gradient is off by its
#: own size.
GRAD_ATOL = 1e-6


def _family(name: str) -> str:
    return name.split("-")[0].removesuffix(".onnx")


@pytest.fixture(scope="module")
def sgd_steps(tmp_path_factory):
    """Each export of :data:`GRADIENTS` trained one SGD update of learning rate 1 on its family's torch batch (the
    whole batch, no row held out for eval), on one rank: name -> (config, the job's output)."""
    from safetensors.numpy import load_file

    from tests.support.exports import EXPORTS

    root = tmp_path_factory.mktemp("torch-gradients")
    cfgs = {}
    for name in GRADIENTS:
        batch = load_file(str(EXPORTS / f"{_family(name)}.grads.safetensors"))
        data = root / f"{_family(name)}.npz"
        if not data.exists():
            np.savez(data, labels=batch["labels"],
                     **{k.removeprefix("input."): v for k, v in batch.items() if k.startswith("input.")})
        cfgs[name] = make_run(root, name.removesuffix(".onnx"), model=export_path(name),
                              data={"train": [str(data)], "test": [str(data)]},
                              train={"batch_size": len(batch["labels"]), "num_train_steps": 1,
                                     "gradient_accumulation_steps": 1, "evaluation_period": 0},
                              optimizer={"name": "sgd", "learning_rate": 1.0}, checkpoint={"period": 1})
    outs = run_ranks_together(*cfgs.values())
    return {name: (cfg, out) for (name, cfg), out in zip(cfgs.items(), outs, strict=True)}


@pytest.mark.parametrize("name", GRADIENTS)
def test_one_sgd_step_moves_every_torch_parameter_by_torchs_gradient(sgd_steps, name):
    """The engine's gradients of the CNN (Conv, BatchNorm with batch statistics), of the LSTM + GRU classifier
    (through the exporters' gate reordering), of Qwen2 (biased query, key and value projections, grouped-query
    attention, RoPE), of Phi-3 (fused query/key/value and gate/up projections), of Gemma, of GPT-NeoX (a per-head
    fused query/key/value projection, partial RoPE, parallel attention and MLP) and of T5 (an encoder and a decoder
    with cross-attention fed by two inputs and an attention mask, one relative position bias table per stack, the
    shared embedding read by both stacks and the LM head: torch's one parameter, trained with the sum of its uses'
    gradients), from both exporters, are torch's: after one SGD step of learning rate 1 every torch parameter is its
    exported value less torch's gradient."""
    from safetensors.numpy import load_file

    from tests.support.exports import EXPORTS

    cfg, out = sgd_steps[name]
    assert out.returncode == 0, out.stdout[-3000:]
    torch_grads = load_file(str(EXPORTS / f"{_family(name)}.grads.safetensors"))
    start = load_file(str(EXPORTS / f"{_family(name)}.safetensors"))
    params = read_params(newest(cfg))
    record = torch_record(_family(name))
    worst = 0.0
    for param in record["parameters"]:
        grad = torch_grads[f"grad.{param}"]
        np.testing.assert_allclose(params[param], start[param] - grad, rtol=0, atol=GRAD_ATOL, err_msg=param)
        worst = max(worst, float(np.abs(params[param] - (start[param] - grad)).max()))
    print(f"{name}: one SGD step vs torch's gradients: max |difference| {worst:.3g}")
    assert max(float(np.abs(torch_grads[f"grad.{p}"]).max()) for p in record["parameters"]) > 1e-2
