"""The benchmark harness's own logic: reading the trainer's progress, paired ratios, and the exported model."""

from __future__ import annotations

import pytest

from bench.common import Setup, parse_result, summarize
from bench.compare import best_label, overhead, paired_best_ratio, paired_ratio, scaling_efficiency, trainer_step_time

SETUP = Setup(shape={}, batch_size=4, warmup_steps=2, timed_steps=4, display_steps=2, mpiexec=("mpiexec",))


def test_trainer_step_time_skips_warmup_and_final_windows():
    lines = [
        "12:00:00 INFO step 2/8 | loss 5.5 | samples_per_s 1.0 | eta 9s",  # warm-up window: skipped
        "12:00:01 INFO step 4/8 | loss 5.4 | lr 0.001 | samples_per_s 16 | eta 4s",  # 2 steps x 2 ranks x 4 / 16 = 1 s
        "12:00:02 INFO step 6/8 | loss 5.3 | samples_per_s 8 | eta 2s",  # 2 s
        "12:00:03 INFO step 8/8 | loss 5.2 | samples_per_s 0.5",  # final window (holds the evaluation): skipped
    ]
    assert trainer_step_time("\n".join(lines), SETUP, world=2) == pytest.approx((1.0 + 2.0) / 4)
    assert trainer_step_time("no progress here", SETUP, world=1) is None


def test_paired_ratios_are_taken_within_a_round():
    runs = {
        "ortflow 1x1": [{"round": 0, "samples_per_s": 10.0, "step_time_s": 1.1},
                        {"round": 1, "samples_per_s": 20.0, "step_time_s": 1.0}],
        "bare 1x1": [{"round": 0, "samples_per_s": 11.0, "step_time_s": 1.0},
                     {"round": 1, "samples_per_s": 21.0, "step_time_s": 1.0}],
        "ortflow 2x1": [{"round": 0, "samples_per_s": 19.0, "step_time_s": 1.0},
                        {"round": 1, "samples_per_s": None, "step_time_s": None}],  # a failed run is left out
    }  # fmt: skip
    assert paired_ratio(runs, "ortflow 1x1", "bare 1x1")["max"] == pytest.approx(20 / 21)
    assert overhead(runs)["max"] == pytest.approx(0.1)
    eff = scaling_efficiency(runs, "ortflow", 2)
    assert eff["n"] == 1 and eff["median"] == pytest.approx(19 / 10 / 2)
    assert summarize([None, 3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}


def test_pytorch_at_its_best_is_the_fastest_mode_of_each_round():
    runs = {
        "ortflow 1x2": [{"round": 0, "samples_per_s": 12.0}, {"round": 1, "samples_per_s": 12.0}],
        "torch 1x2": [{"round": 0, "samples_per_s": 10.0}, {"round": 1, "samples_per_s": 6.0}],
        "torch-compile 1x2": [{"round": 0, "samples_per_s": 8.0}, {"round": 1, "samples_per_s": 15.0}],
        "torch-bf16 1x2": [{"round": 0, "samples_per_s": None}, {"round": 1, "samples_per_s": None}],  # failed
    }  # fmt: skip
    ratio = paired_best_ratio(runs, ["ortflow 1x2"], ["torch 1x2", "torch-compile 1x2", "torch-bf16 1x2"])
    assert (ratio["min"], ratio["max"]) == (pytest.approx(12 / 15), pytest.approx(12 / 10))
    assert ratio["best"] == [["ortflow 1x2", "torch 1x2"], ["ortflow 1x2", "torch-compile 1x2"]]
    summary = {label: {"samples_per_s": summarize([x["samples_per_s"] for x in recs])} for label, recs in runs.items()}
    assert best_label(summary, ["torch 1x2", "torch-compile 1x2", "torch-bf16 1x2"]) == "torch-compile 1x2"
    assert best_label(summary, ["torch-bf16 1x2"]) is None


def test_torch_modes_are_checked_by_name():
    from bench.__main__ import torch_modes

    assert torch_modes("eager,compile") == ["eager", "compile"]
    assert torch_modes("auto")[:2] == ["eager", "compile"]
    with pytest.raises(SystemExit, match="--torch-modes"):
        torch_modes("eager,fast")


def test_parse_result_takes_the_last_tagged_line():
    assert parse_result('noise\n[0] BENCH_RESULT {"a": 1}\nBENCH_RESULT {"a": 2}\n') == {"a": 2}
    assert parse_result("nothing") is None


def test_exported_gpt_trains_in_the_engine_with_the_same_first_loss(tmp_path):
    torch = pytest.importorskip("torch")  # the bench extra
    import numpy as np
    import torch.nn.functional as F

    from bench.torch_gpt import GPT, GPTShape, export_onnx
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.engine import api

    shape = GPTShape(vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=2)
    model = GPT(shape, seed=0)
    assert sum(p.numel() for p in model.parameters()) == shape.num_params()
    path = export_onnx(model, tmp_path / "gpt.onnx")
    cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                            "data": {"train": [str(tmp_path / "unused.npz")]},
                            "train": {"batch_size": 2, "num_train_steps": 1}})  # fmt: skip
    configure(cfg)
    state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
    trained = {name for name, p in state.parameters if p.requires_grad}
    assert trained == {name for name, _ in model.named_parameters()}  # the causal mask is not trained
    module = api.Module(str(cfg.artifacts_dir / "training_model.onnx"), state,
                        str(cfg.artifacts_dir / "eval_model.onnx"))  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 32, (2, 9), dtype=np.int64)
    x, y = ids[:, :-1].copy(), ids[:, 1:].reshape(-1).copy()
    engine_loss = float(module(x, y))
    torch_loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).item()
    assert engine_loss == pytest.approx(torch_loss, rel=1e-5)
    grad = state.parameters["h.0.q.weight"].grad
    assert np.abs(grad).max() > 0  # gradients reach the attention weights
