"""``python -m bench overhead``: its bare loop runs on the configured run's artifacts."""

from __future__ import annotations

import numpy as np

from bench import bench_overhead
from ortflow.examples.gpt import build_gpt


def test_the_bare_loop_trains_with_ortflows_update_on_the_runs_artifacts(tmp_path):
    build_gpt(tmp_path / "gpt.onnx", seq_len=128, d_model=16, num_layers=1, num_heads=2)  # make_run keeps it
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    cfg = bench_overhead.make_run(tmp_path, steps=2, display=1)
    assert not (cfg.artifacts_dir / "optimizer_model.onnx").exists()  # configure builds no optimizer graph
    times = bench_overhead.bare(cfg, steps=3, warmup=1)
    assert set(times) == {"fb", "upd"} and all(np.isfinite(v) and v > 0 for v in times.values())
