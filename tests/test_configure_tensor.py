"""configure with distributed.horizontal_parallel_size > 1: every rank's pieces built once, or a clear refusal."""

from __future__ import annotations

import logging

import pytest

from ortflow.artifacts_folder import ARTIFACT_FILES, piece_dir, read_tensor_record
from ortflow.config import ConfigError, config_from_dict
from ortflow.configure.configure import configure
from ortflow.examples.gpt import build_gpt


def tensor_cfg(tmp_path, model_path, hp=2):
    return config_from_dict({
        "name": "t", "output_dir": str(tmp_path / "run"), "model": {"path": str(model_path)},
        "data": {"train": str(tmp_path / "train.parquet")},
        "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"num_ranks": hp, "horizontal_parallel_size": hp},
    })


def test_every_rank_gets_its_pieces_and_the_split_is_logged_and_recorded(tmp_path, caplog):
    path = tmp_path / "gpt.onnx"
    build_gpt(path, vocab_size=64, seq_len=8, d_model=32, num_layers=2, num_heads=4)
    cfg = tensor_cfg(tmp_path, path)
    with caplog.at_level(logging.INFO):
        first = configure(cfg)
    record = read_tensor_record(cfg.artifacts_dir)
    # embedding, 2 x (attention, MLP), LM head, each with the replicated nodes before it; the loss tail
    assert record["size"] == 2 and len(record["pieces"]) == 7
    assert [p["parallel"] for p in record["pieces"]] == [True] * 6 + [False]
    mlp = record["pieces"][2]  # residual add, ln_2, the MLP region
    assert mlp["partial_sends"] == ["h0.mlp.proj.mm"] and mlp["sends"] == ["h0.mlp.proj.mm", "h0.resid_attn"]
    assert sorted(mlp["replicated_parameters"]) == ["h0.attn.proj.bias", "h0.ln_2.bias", "h0.ln_2.weight"]
    assert record["slicing"]["h0.attn.q.weight"] == [1, 1] and record["slicing"]["h0.mlp.proj.weight"] == [0, 1]
    assert record["slicing"]["wte.weight"] == [0, 1] and record["slicing"]["lm_head.weight"] == [1, 1]
    for rank in (0, 1):
        for piece in range(7):
            assert all((piece_dir(cfg.artifacts_dir, rank, piece) / f).exists() for f in ARTIFACT_FILES)
    assert first.info["tensor_parallel_split"] == record["split"]
    assert "vocabulary split of ['lm_head.weight']" in caplog.text
    assert "region 3: columns ['h1.mlp.fc.weight']" in caplog.text
    import onnx

    embedding = onnx.load(str(piece_dir(cfg.artifacts_dir, 1, 0) / "training_model.onnx"), load_external_data=False)
    ops = {n.op_type for n in embedding.graph.node}
    assert "GatherND" in ops and "Gather" not in ops  # the rank's vocabulary slice read with GatherND on the CPU
    assert configure(cfg).reused  # built once
    assert any("tensor/rank-01/piece-06" in name for name in first.info["artifact_sha256"])


def test_a_size_that_does_not_divide_the_heads_is_refused_before_building(tmp_path):
    path = tmp_path / "gpt.onnx"
    build_gpt(path, vocab_size=64, seq_len=8, d_model=32, num_layers=1, num_heads=4)
    cfg = tensor_cfg(tmp_path, path, hp=3)
    with pytest.raises(ConfigError, match=r"horizontal_parallel_size 3 does not divide the 4 heads of "
                                          r"h0.attn.q.weight"):
        configure(cfg)
    assert not (cfg.artifacts_dir / "tensor").exists()

