"""The trainer's shared engine arena (ortflow.trainer.arena): the engine's gradients end up back to back."""

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from ortflow.trainer.arena import MAX_FIRST_CHUNK, first_chunk_bytes
from tests.support.fixed_batch_mlp import build_fixed_batch_classifier

ROOT = Path(__file__).resolve().parents[2]


def test_first_chunk_holds_the_gradients_twice_over_in_whole_mib():
    for size in (1, 2**20, 13_293_568, 2**30 - 2**20):
        chunk = first_chunk_bytes(size)
        assert chunk % 2**20 == 0 and chunk >= 2 * size + 2**20


def test_the_first_chunk_of_a_model_past_half_a_billion_parameters_is_one_the_engine_accepts():
    import onnxruntime

    for size in (2**30, 2_406_733_824, 5 * 2**30 + 3):  # 0.27B, the 600M Llama's, 1.3B fp32 parameters
        chunk = first_chunk_bytes(size)
        assert chunk == MAX_FIRST_CHUNK and chunk % 2**20 == 0
        onnxruntime.OrtArenaCfg({"initial_chunk_size_bytes": chunk, "arena_extend_strategy": 0})  # a C int


def test_shared_arena_lays_the_engine_gradients_back_to_back(tmp_path):
    from ortflow.engine import artifacts

    # torch.onnx.export-shaped (fixed batch, Shape arithmetic into Reshape), wide enough that the gradients (4.7 MB)
    # outgrow a session arena's first chunk and scatter over its regions. Sizes in whole 256-byte units: the arena
    # rounds each buffer up to one, so a 3-value bias would leave a gap (and start a new run) behind it.
    model = onnx.load(str(build_fixed_batch_classifier(tmp_path / "model.onnx", features=512, hidden=2048,
                                                       classes=64)))  # fmt: skip
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        artifacts.generate_artifacts(model, requires_grad=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
                                     frozen_params=[], loss=artifacts.LossType.CrossEntropyLoss, optimizer=None,
                                     artifact_directory=str(tmp_path))  # fmt: skip
    finally:
        os.chdir(cwd)
    script = str(Path(__file__).with_name("arena_rank.py"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = dict(zip(["own", "shared"], map(int, out.stdout.split("RUNS own ")[1].split(" shared ")), strict=True))
    assert counts["own"] > 1, counts  # what the shared arena fixes happens with the engine's default
    assert counts["shared"] == 1, counts


def test_an_existing_shared_arena_is_used_rather_than_an_error(tmp_path):
    # A pipeline stage registers the process's shared arena its own way (pipeline_stage.py); the whole-model path
    # must then use that one, not fail. Fresh process: the engine keeps one shared arena per process.
    code = (
        "import onnxruntime as ort\n"
        "from ortflow.trainer import arena\n"
        "info = ort.OrtMemoryInfo('Cpu', ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)\n"
        "ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))\n"
        "options = arena.use_gradient_arena(ort.SessionOptions(), 2**20)\n"
        "print('USES', options.get_session_config_entry('session.use_env_allocators'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "USES 1" in out.stdout


def test_a_gpu_ranks_stage_and_piece_sessions_share_one_cuda_arena_without_memory_patterns(monkeypatch):
    # A tensor-parallel rank opens two sessions per piece (92 pieces per rank for the 1.12B Llama at tp 2): with an
    # arena each, the rank holds the sum of their peaks. The CPU build cannot make a CUDA arena, so the engine's
    # registration is recorded here; the GPU tests (tests/gpu/test_gpu_tensor.py) train with the real one.
    import onnxruntime

    from ortflow.trainer import arena
    from ortflow.trainer.comm.engine_buffers import DeviceBuffers, engine_buffers

    made = []
    monkeypatch.setattr(onnxruntime, "create_and_register_allocator_v2",
                        lambda provider, info, options, config: made.append((provider, info, options)))
    monkeypatch.setattr(onnxruntime, "OrtMemoryInfo", lambda *args: args)  # the engine's object shows no fields
    monkeypatch.setattr(arena, "_DEVICE_ARENA", [])
    buffers = engine_buffers("cuda:1", comm=None)
    assert isinstance(buffers, DeviceBuffers) and buffers.device_index == 1
    first, second = (buffers.stage_options(onnxruntime.SessionOptions()) for _ in range(2))
    assert len(made) == 1, "one arena per process, made by the first session's options"
    provider, info, options = made[0]
    assert provider == "CUDAExecutionProvider" and options == {"device_id": "1"}
    assert info == ("Cuda", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 1, onnxruntime.OrtMemType.DEFAULT)
    for opts in (first, second):
        assert opts.get_session_config_entry("session.use_env_allocators") == "1"
        assert not opts.enable_mem_pattern
    with pytest.raises(RuntimeError, match="on GPU 1, not 0"):
        DeviceBuffers(None, 0).stage_options(onnxruntime.SessionOptions())
