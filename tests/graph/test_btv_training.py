"""A GPT-2-style model exported with [B, T, V] logits trains on text data with no graph edits by the user."""

from __future__ import annotations

import json
import re

import numpy as np
import onnxruntime

from ortflow.dataprep.specs import read_train_inputs
from ortflow.export.model import export_model
from tests.support.gpt import gpt2_style
from tests.support.runs import final_parameters, make_run, run_ranks


def test_text_data_trains_a_btv_logits_model_end_to_end(tmp_path):
    model = gpt2_style(tmp_path / "gpt2.onnx", vocab=256, seq_len=16, width=16, heads=2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = make_run(
        tmp_path, "btv", model=model,
        data={"train": [str(corpus)], "format": "text", "text": {"seq_len": 16}, "eval_fraction": 0.2},
        train={"batch_size": 4, "num_train_steps": 8, "display_loss_steps": 1, "evaluation_period": 0},
        checkpoint={"period": 0}, distributed={"num_ranks": 1},
    )
    specs = {s.name: s for s in read_train_inputs(cfg.output_dir)}
    # The label input the preparation pass declares is [batch, T]: text windows of [T] batch into it unmerged.
    assert specs["labels"].dtype == "int64" and list(specs["labels"].shape) == ["batch", 16]
    record = json.loads((cfg.output_dir / "configure.json").read_text())
    assert record["model_outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["batch", 16, 256]}]
    result = run_ranks(cfg)
    assert result.returncode == 0, result.stdout[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+/\d+ \| loss ([-+.\deE]+)", result.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], result.stdout[-3000:]
    assert all(np.isfinite(v).all() for v in final_parameters(cfg).values())
    # The exported model has the user's output, [B, T, V], not the flattened one the loss reads.
    exported = export_model(cfg.output_dir, tmp_path / "model.onnx")
    assert exported.outputs == ("logits",)
    session = onnxruntime.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    ids = np.frombuffer(b"the quick brown fox jumps over t", np.uint8).astype(np.int64).reshape(2, 16)
    assert session.run(None, {"input_ids": ids})[0].shape == (2, 16, 256)
