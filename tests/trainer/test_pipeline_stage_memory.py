"""A pipeline stage's two engine sessions share their memory.

A stage runs the eval model's forward and then the training model's recompute + backward for every micro-batch
(trainer/parallel/pipeline_stage.py). Measured (bench/pipeline_memory.py): with the engine's default options both
sessions keep their peaks, and even one shared arena kept both memory-pattern blocks (stage 0 at 32 sequences: 97 MiB
vs 70 MiB for its training call alone). The first test pins the fix: in a fresh process, the trainer's stage sessions
running eval forward + training call peak within 15% (+1 MiB of allocator slack) of what the training call alone
needs without any arena (freed memory returned to the system at once: the call's own working set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.runs import make_text_run

ROOT = Path(__file__).resolve().parents[2]


def _peak(run_dir: Path, calls: str, allocator: str, batch: int) -> float:
    """Peak RSS growth (MiB) of stage 0's ``calls`` in a fresh process (bench/pipeline_memory.py's probe)."""
    cmd = [sys.executable, "-m", "bench.pipeline_memory", "--probe", str(run_dir), "--stage", "0", "--calls", calls,
           "--allocator", allocator, "--batch", str(batch), "--repeats", "2"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth"] / 2**20


def test_a_stage_forward_and_backward_sessions_share_one_working_set(tmp_path):
    from ortflow.examples.gpt import build_gpt

    tmp_path.mkdir(exist_ok=True)
    build_gpt(tmp_path / "gpt.onnx", seq_len=64, d_model=64, num_layers=2, num_heads=2)  # make_text_run uses it
    cfg = make_text_run(tmp_path, "pp2", data={"text": {"seq_len": 64}},
                        distributed={"num_ranks": 2, "pipeline_parallel_size": 2})
    alone = _peak(cfg.output_dir, "train", "none", 16)
    both = _peak(cfg.output_dir, "eval+train", "trainer", 16)
    eval_only = _peak(cfg.output_dir, "eval", "none", 16)
    print(f"stage 0 at 16 sequences: training call alone (no arena) {alone:.1f} MiB, eval forward alone "
          f"{eval_only:.1f} MiB, eval + training with the trainer's options {both:.1f} MiB")
    assert eval_only > 1.0 and alone > eval_only  # the model is big enough for the check to mean something
    assert both <= 1.15 * alone + 1.0, (both, alone)
