"""bench_tensor's summary and report: medians over rounds of the slowest rank, samples/s, and what a GPU record says."""

from __future__ import annotations

import pytest

from bench.bench_tensor import report, summarize

MEMORY = {"split_parameters": 8, "split_gradients": 8, "split_optimizer_state": 16, "all_parameters": 10,
          "optimizer_state_total": 20}
HALF = {"split_parameters": 4, "split_gradients": 4, "split_optimizer_state": 8, "all_parameters": 6,
        "optimizer_state_total": 12}


def _rank(step: float, sums: float = 0.0, calls: float = 0.0, samples: int = 16, memory=MEMORY) -> dict:
    return {"step_s": step, "allreduce_s": sums, "engine_calls_s": calls, "samples_per_step": samples,
            "memory": memory}


def test_summary_takes_each_rounds_slowest_rank_and_the_median_round():
    results = {"hp1": [[_rank(0.033)], [_rank(0.032)], [_rank(0.040)]],
               "dp2": [[_rank(0.036, samples=32), _rank(0.037, samples=32)]] * 3,
               "hp2": [[_rank(0.054, 0.009, 0.042, memory=HALF), _rank(0.056, 0.008, 0.043, memory=HALF)],
                       [_rank(0.055, 0.009, 0.042, memory=HALF), _rank(0.053, 0.009, 0.041, memory=HALF)],
                       [_rank(0.070, 0.010, 0.050, memory=HALF), _rank(0.060, 0.009, 0.045, memory=HALF)]]}
    summary = summarize(results)
    assert summary["timing"]["hp1"]["step_s"] == pytest.approx(0.033)
    assert summary["timing"]["hp2"]["step_s"] == pytest.approx(0.056)  # rounds' slowest ranks 0.056, 0.055, 0.070
    assert summary["timing"]["dp2"]["samples_per_s"] == pytest.approx(32 / 0.037)
    assert summary["memory_ratio_vs_hp1"]["hp2 rank 0"]["split_parameters"] == 0.5
    record = {"command": "python -m bench tensor --device cuda", "host": "h", "cores": 64, "shape": {"d_model": 2048},
              "batch_size": 8, "micro": 2, "device": "cuda", "gpus": "4 x NVIDIA H100", "summary": summary}
    text = report(record)
    assert text.startswith("# Tensor parallelism on GPUs (h, 64 cores)")
    assert "GPUs: 4 x NVIDIA H100" in text and "batch 8 x 2 micro-batches" in text
    assert summary["timing"]["hp2"]["engine_calls_s"] == pytest.approx(0.043)  # each round's slowest rank's median
    assert "| hp2 | 0.056 | 285.7 | 0.009 | 0.043 |" in text and "hp2 step time / hp1: 1.70" in text
    assert report({**record, "device": "cpu", "gpus": None}).startswith("# Tensor parallelism on CPU ranks")
