"""bench_pipeline's GPU contenders (pp2 keeping its activations against pp2-recompute) and its GPU summary and
report, checked on CPU: what each contender's config asks for, and the rows and paired ratios the report gives."""

from __future__ import annotations

import json

import pytest
import yaml

from bench import bench_pipeline
from bench.bench_pipeline import gpu_report, gpu_summarize


def test_the_gpu_contenders_are_pp2_keeping_and_recomputing_on_one_configures_stages(tmp_path, monkeypatch):
    for key, value in {"d_model": 32, "num_heads": 2, "num_layers": 2, "seq_len": 16}.items():
        monkeypatch.setitem(bench_pipeline.SHAPE, key, value)
    (tmp_path / "corpus.txt").write_text("each stage reads the same text. " * 300)
    runs = bench_pipeline.gpu_runs(tmp_path, [2, 4], batch=2)
    assert sorted(runs) == sorted([("pp1", 2), ("dp2", 2), ("dp2", 4), ("pp2", 2), ("pp2", 4),
                                   ("pp2-recompute", 2), ("pp2-recompute", 4)])

    def config(kind: str, m: int) -> dict:
        return yaml.safe_load((runs[(kind, m)][0] / "config.yaml").read_text())

    for m in (2, 4):
        kept, recompute = config("pp2", m), config("pp2-recompute", m)
        assert kept["distributed"]["recompute_forward"] is False and recompute["distributed"]["recompute_forward"]
        for c in (kept, recompute):
            assert c["distributed"]["pipeline_parallel_size"] == 2 and c["distributed"]["device"] == "cuda"
            assert c["train"]["gradient_accumulation_steps"] == m
    assert config("dp2", 4)["distributed"]["pipeline_parallel_size"] == 1
    # One configure built the stages, one the unsplit model: the others hold hard links of their files.
    stages = runs[("pp2", 2)][0] / "artifacts" / "checkpoint"
    for kind, m in (("pp2", 4), ("pp2-recompute", 2), ("pp2-recompute", 4)):
        assert (runs[(kind, m)][0] / "artifacts" / "checkpoint").stat().st_ino == stages.stat().st_ino
    unsplit = runs[("pp1", 2)][0] / "artifacts" / "training_model.onnx"
    assert (runs[("dp2", 4)][0] / "artifacts" / "training_model.onnx").stat().st_ino == unsplit.stat().st_ino


def test_the_gpu_bench_cuts_its_pipelines_where_it_is_told(tmp_path, monkeypatch):
    for key, value in {"d_model": 32, "num_heads": 2, "num_layers": 2, "seq_len": 16}.items():
        monkeypatch.setitem(bench_pipeline.SHAPE, key, value)
    (tmp_path / "corpus.txt").write_text("each stage reads the same text. " * 300)
    runs = bench_pipeline.gpu_runs(tmp_path, [2], batch=2, cuts=("h1.resid_attn",))
    for kind in ("pp2", "pp2-recompute"):
        assert yaml.safe_load((runs[(kind, 2)][0] / "config.yaml").read_text())["model"]["pipeline_cuts"] == [
            "h1.resid_attn"]
        stages = json.loads((runs[(kind, 2)][0] / "artifacts" / "stages" / "stages.json").read_text())
        assert stages["cuts"] == ["h1.resid_attn"] and stages["stages"][1]["receives"] == ["h1.resid_attn"]
    assert yaml.safe_load((runs[("dp2", 2)][0] / "config.yaml").read_text())["model"]["pipeline_cuts"] == []


def test_the_gpu_bench_configures_every_contender_nondeterministic_when_told(tmp_path, monkeypatch):
    for key, value in {"d_model": 32, "num_heads": 2, "num_layers": 2, "seq_len": 16}.items():
        monkeypatch.setitem(bench_pipeline.SHAPE, key, value)
    for deterministic in (True, False):
        root = tmp_path / str(deterministic)
        root.mkdir()
        (root / "corpus.txt").write_text("each stage reads the same text. " * 300)
        runs = bench_pipeline.gpu_runs(root, [2], batch=2, deterministic=deterministic)
        for run_dir, _ in runs.values():
            config = yaml.safe_load((run_dir / "config.yaml").read_text())
            assert config["distributed"]["deterministic_compute"] is deterministic, run_dir


def _ranks(step0: float, engine0: float, step1: float = 0.0, samples: int = 32, kept: int = 0,
           messages: str | None = "nccl") -> list[dict]:
    return [{"rank": 0, "step_s": step0, "compute_s": engine0, "samples_per_step": samples, "kept_parts": kept,
             "device_memory_used": 3 * 2**30, "messages": messages},
            {"rank": 1, "step_s": step1 or step0, "compute_s": engine0 / 2, "samples_per_step": samples,
             "kept_parts": 0, "device_memory_used": 2 * 2**30, "messages": messages}]


def test_the_gpu_report_sets_pp2_keeping_against_pp2_recomputing_round_by_round():
    results = {"pp1-m8": [_ranks(0.010, 0.010)[:1]],
               "dp2-m8": [_ranks(0.016, 0.015, samples=320)] * 2,
               "pp2-m8": [_ranks(0.040, 0.030, kept=1), _ranks(0.050, 0.036, kept=1)],
               "pp2-recompute-m8": [_ranks(0.036, 0.020, messages="host"), _ranks(0.040, 0.024, messages="host")]}
    summary = gpu_summarize(results, [8])
    row = summary["throughput"][8]
    assert row["pp2"]["samples_per_s"] == pytest.approx(720.0)  # median of 32/0.040 and 32/0.050
    assert row["pp2-recompute"]["stage_engine_ms"][0] == pytest.approx(22.0)
    # Paired within a round: engine 0.030/0.020 and 0.036/0.024 (both 1.5); samples/s 0.036/0.040 and 0.040/0.050.
    assert row["kept_over_recompute"]["stage0_engine_ms"] == pytest.approx(1.5)
    assert row["kept_over_recompute"]["samples_per_s"] == pytest.approx((0.9 + 0.8) / 2)
    assert row["pp2"]["kept_parts"] == [1, 0] and row["pp2-recompute"]["kept_parts"] == [0, 0]
    assert row["pp2"]["messages"] == ["nccl", "nccl"] and row["pp2-recompute"]["messages"] == ["host", "host"]
    text = gpu_report({"command": "python -m bench pipeline-gpu --micro 8", "host": "h", "shape": {"d_model": 2048},
                       "batch_size": 16, "rounds": 3, "rounds_run": 2, "timed_steps": 6, "summary": summary})
    assert "medians of 2 rounds x 6 timed updates" in text
    assert "| 8 | dp2 | 20000.0 | 1.00 |" in text
    assert "| 8 | pp2 | 720.0 | 0.04 | 45.00 | 45.00 | 33.00 | 16.50 |" in text and "| 1, 0 | nccl, nccl |" in text
    assert "| 0, 0 | host, host |" in text  # which way each stage's messages went
    assert "| 8 | pp2-recompute | 844.4 | 0.04 | 38.00 | 38.00 | 22.00 | 11.00 |" in text
    assert "- m = 8: stage 0 engine ms 1.50x, samples/s 0.85x (2 rounds)" in text
    assert "pp2-recompute stage 0 3072" in text
    assert "--micro 8" not in text  # the command is write_result's provenance block's, once


def test_gpu_main_alternates_the_contenders_and_starts_no_round_past_the_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_pipeline, "SHAPE", dict(bench_pipeline.SHAPE))  # gpu_main sets the model's shape
    launched = []

    def launch(run_dir, ranks, warmup, steps):
        launched.append(run_dir.name)
        kept = int(run_dir.name.startswith("pp2-m"))
        return _ranks(0.04, 0.03, kept=kept)[:ranks]

    monkeypatch.setattr(bench_pipeline, "_launch", launch)
    readings = iter(range(0, 1000, 10))  # each reading of the clock 10 s after the last
    bench_pipeline.gpu_main(["--micro", "2", "--rounds", "5", "--budget-s", "15", "--d-model", "32",
                             "--num-heads", "2", "--num-layers", "1", "--seq-len", "16", "--out", str(tmp_path)],
                            clock=lambda: next(readings))
    # Round 1 in order, round 2 reversed (pp1, memory only, once); a third would start 20 s after the first: past
    # the budget (readings: 0 and 10 around the configures, 20 at the first round, 30 and 40 after each round).
    assert launched == ["pp1", "dp2-m2", "pp2-m2", "pp2-recompute-m2", "pp2-recompute-m2", "pp2-m2", "dp2-m2"]
    (json_path,) = tmp_path.glob("pipeline-gpu-*.json")
    record = json.loads(json_path.read_text())
    assert record["rounds_run"] == 2 and record["shape"]["d_model"] == 32
    assert "| 2 | pp2-recompute |" in json_path.with_suffix(".md").read_text()
