"""GPU set-up errors and library lookup: these run everywhere (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import onnxruntime
import pytest

from ortflow import cuda_libs
from ortflow.config import config_from_dict
from ortflow.trainer.runtime import select_device


def _cfg(tmp_path: Path, **distributed):
    return config_from_dict({
        "output_dir": str(tmp_path / "run"), "model": {"path": str(tmp_path / "m.onnx")},
        "data": {"train": [str(tmp_path / "d.npz")]}, "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": distributed,
    })  # fmt: skip


def test_config_accepts_cuda_and_nccl(tmp_path):
    cfg = _cfg(tmp_path, device="cuda", use_nccl=True, num_ranks=2)
    assert cfg.distributed.device == "cuda" and cfg.distributed.use_nccl


def test_cuda_without_nccl_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="device cuda needs distributed.use_nccl: true"):
        _cfg(tmp_path, device="cuda", use_nccl=False)


@pytest.mark.skipif("CUDAExecutionProvider" in onnxruntime.get_available_providers(), reason="GPU engine installed")
def test_cuda_with_the_cpu_engine_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"CPU build: install onnxruntime-training==1\.19\.2"):
        select_device(_cfg(tmp_path, device="cuda", use_nccl=True), 0)


def test_libraries_are_found_in_pip_nvidia_folders_and_the_env_folders(tmp_path):
    pip_lib = tmp_path / "site" / "nvidia" / "cublas" / "lib"
    pip_lib.mkdir(parents=True)
    (pip_lib / "libcublas.so.11").write_bytes(b"")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "libcublas.so.11").write_bytes(b"")
    dirs = cuda_libs.search_dirs({cuda_libs.ENV_DIRS: str(extra)}, [str(tmp_path / "site")])
    assert dirs == [extra, pip_lib]  # the explicit folders win
    assert cuda_libs.find("libcublas.so.11", dirs) == extra / "libcublas.so.11"
    assert cuda_libs.find("libcudnn.so.8", dirs) is None


def test_a_library_that_cannot_load_is_reported_missing(tmp_path):
    (tmp_path / "libortflow_absent.so.1").write_bytes(b"not an ELF file")
    report = cuda_libs.preload(("libortflow_absent.so.1",), (), dirs=[tmp_path])
    assert report.missing == ["libortflow_absent.so.1"] and not report.loaded


def test_doctor_names_gpus_newer_than_the_engines_machine_code():
    assert cuda_libs.jit_note([]) is None
    assert cuda_libs.jit_note([(8, 0), (8, 6)]) is None  # A100, RTX 30: the engine's own machine code
    note = cuda_libs.jit_note([(9, 0), (9, 0), (8, 0)])
    assert note is not None and "on sm_90 the driver compiles its kernels from PTX at first use" in note
    assert "sm_86" in note and "CUDA_CACHE_PATH" in note
    assert "sm_89, sm_90" in cuda_libs.jit_note([(9, 0), (8, 9)])



def test_ops_that_need_a_missing_cudnn_library_are_named():
    report = cuda_libs.LoadReport(loaded={"libcudnn_cnn_train.so.8": "/x/libcudnn_cnn_train.so.8"})
    assert cuda_libs.missing_for_ops(["Conv", "Relu", "Gemm"], report) == [
        ("convolutions", ["Conv"], ["libcudnn_cnn_infer.so.8"])]
    assert cuda_libs.missing_for_ops(["MatMul", "Relu"], report) == []  # a transformer needs neither
    rows = {item: (found, detail) for item, found, detail in cuda_libs.optional_rows(report)}
    assert rows["cuDNN convolutions"][0] is False and "only models with Conv" in rows["cuDNN convolutions"][1]
    assert rows["cuDNN RNNs"][0] is False


def test_a_cuda_rank_refuses_a_conv_model_without_cudnns_convolution_library(tmp_path, monkeypatch):
    """cuDNN aborts the process at the first convolution when its convolution library is missing (no Python error):
    the rank refuses at start instead, naming the library and the fix. The engine's providers, the GPU and the library
    search are replaced here; the model's op types come from configure's record."""
    import json

    from ortflow.trainer import startup

    cfg = _cfg(tmp_path, device="cuda", use_nccl=True)
    cfg.output_dir.mkdir(parents=True)
    (cfg.output_dir / "configure.json").write_text(json.dumps({"op_types": ["BatchNormalization", "Conv", "Gemm"]}))
    monkeypatch.setattr(startup.onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    monkeypatch.setattr(cuda_libs, "gpu_for_local_rank", lambda rank, size: 0)
    engine = {soname: "/lib/" + soname for soname in cuda_libs.ENGINE_LIBRARIES}
    monkeypatch.setattr(cuda_libs, "preload", lambda: cuda_libs.LoadReport(loaded=engine))
    with pytest.raises(RuntimeError, match=r"Conv nodes need cuDNN's convolutions library \(libcudnn_cnn_infer.so.8, "
                                           r"libcudnn_cnn_train.so.8\).*install nvidia-cudnn-cu11"):
        select_device(cfg, 0)
    (cfg.output_dir / "configure.json").write_text(json.dumps({"op_types": ["Gemm", "Relu"]}))
    assert select_device(cfg, 0) == "cuda:0"


def test_configure_records_the_models_op_types(tmp_path):
    from ortflow.trainer.startup import recorded_op_types
    from tests.trainer.test_batchnorm_mpi import cnn_run

    cfg = cnn_run(tmp_path, "cnn", 1)
    assert {"Conv", "BatchNormalization", "Gemm"} <= set(recorded_op_types(cfg.output_dir))


def test_validate_names_the_cuda_libraries_a_rank_would_not_find(monkeypatch):
    """Where the GPU engine is installed, validate --deep reports what select_device would refuse: a missing engine
    library, and cuDNN's convolution library for the CNN export (the providers and the library search replaced here);
    where only the CPU engine is installed it reports nothing (the GPU hosts may differ)."""
    from ortflow.validate import cuda_library_problems
    from tests.support.exports import export_path

    cnn, gpt2 = export_path("cnn.onnx"), export_path("gpt2.onnx")
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert cuda_library_problems(cnn) == []
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    loaded = {soname: "/lib/" + soname for soname in cuda_libs.ENGINE_LIBRARIES if soname != "libcublas.so.11"}
    monkeypatch.setattr(cuda_libs, "preload", lambda: cuda_libs.LoadReport(loaded=loaded, missing=["libcublas.so.11"]))
    problems = cuda_library_problems(cnn)
    assert len(problems) == 2
    assert "the GPU engine needs libcublas.so.11" in problems[0]
    assert "Conv nodes need cuDNN's convolutions library (libcudnn_cnn_infer.so.8" in problems[1]
    assert "nvidia-cudnn-cu11" in problems[1]
    assert cuda_library_problems(gpt2) == problems[:1]  # no convolution in GPT-2
