"""Find and load the CUDA libraries the engine's GPU build needs, so nobody edits LD_LIBRARY_PATH.

The GPU engine (``onnxruntime-training==1.19.2``) links against CUDA 11.8 and cuDNN 8 by soname
(``libcudart.so.11.0``, ``libcublas.so.11``, ``libcudnn.so.8``, ...). The pip packages ``nvidia-*-cu11`` install those
files under ``site-packages/nvidia/<part>/lib``, a folder the dynamic loader does not search. Loading each file once,
by full path and with ``RTLD_GLOBAL``, before the engine creates its first CUDA session makes the loader reuse it when
the engine's CUDA provider (and cuDNN's own sub-libraries) ask for the soname. NCCL (``libnccl.so.2``) is found the
same way for CuPy.

Search order: the folders in ``ORTFLOW_CUDA_LIB_DIRS`` (``os.pathsep``-separated), then every ``nvidia/*/lib`` folder
on ``sys.path``, then the loader's own path (``LD_LIBRARY_PATH``, ldconfig). Only ``ctypes`` is imported here: the
module is safe to import anywhere (``ortflow doctor`` uses it on machines without GPUs).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ortflow.gpus import gpu_capabilities, gpu_count, gpu_names

#: Sonames the engine's CUDA provider needs, in dependency order (cuBLASLt before cuBLAS).
ENGINE_LIBRARIES = (
    "libcudart.so.11.0",
    "libcublasLt.so.11",
    "libcublas.so.11",
    "libcufft.so.10",
    "libcurand.so.10",
    "libcudnn.so.8",
    "libcudnn_ops_infer.so.8",
    "libcudnn_ops_train.so.8",
)
#: Loaded when present but not needed by every model: cuDNN's convolution and RNN libraries, by the ops that need
#: them. cuDNN loads them at the first such op and aborts the process (no Python error) when they are missing.
OPTIONAL_FOR_OPS = {
    "convolutions": (("Conv", "ConvTranspose", "FusedConv"), ("libcudnn_cnn_infer.so.8", "libcudnn_cnn_train.so.8")),
    "RNNs": (("LSTM", "GRU", "RNN"), ("libcudnn_adv_infer.so.8", "libcudnn_adv_train.so.8")),
}
OPTIONAL_LIBRARIES = tuple(soname for _, sonames in OPTIONAL_FOR_OPS.values() for soname in sonames)
NCCL_LIBRARY = "libnccl.so.2"
ENV_DIRS = "ORTFLOW_CUDA_LIB_DIRS"
#: The newest compute capability the GPU engine carries machine code (and PTX) for: sm_60 to sm_86.
ENGINE_NEWEST_SASS = (8, 6)


def jit_note(capabilities: list[tuple[int, int]]) -> str | None:
    """What ``ortflow doctor`` says about GPUs newer than the engine's machine code, or None when there is none."""
    newer = sorted({c for c in capabilities if c > ENGINE_NEWEST_SASS})
    if not newer:
        return None
    names = ", ".join(f"sm_{major}{minor}" for major, minor in newer)
    return (f"the engine carries machine code up to sm_{ENGINE_NEWEST_SASS[0]}{ENGINE_NEWEST_SASS[1]}: on {names} the "
            "driver compiles its kernels from PTX at first use (about a minute in a job's first updates), then "
            "reuses its cache (~/.nv/ComputeCache, CUDA_CACHE_PATH; docs/gpu.md)")


@dataclass
class LoadReport:
    """What :func:`preload` found: soname -> path (or "system" when only the loader's own path had it)."""

    loaded: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)


def search_dirs(environ: dict[str, str] | os._Environ = os.environ, paths: list[str] | None = None) -> list[Path]:
    """Folders to look in, in order: ``ORTFLOW_CUDA_LIB_DIRS``, then ``nvidia/*/lib`` of each ``sys.path`` entry."""
    dirs = [Path(p) for p in environ.get(ENV_DIRS, "").split(os.pathsep) if p]
    for entry in sys.path if paths is None else paths:
        dirs += sorted(Path(p) for p in glob.glob(os.path.join(entry or ".", "nvidia", "*", "lib")))
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def find(soname: str, dirs: list[Path]) -> Path | None:
    """The first ``dirs/soname`` that exists."""
    return next((d / soname for d in dirs if (d / soname).exists()), None)


_LOADED: dict[str, ctypes.CDLL] = {}  # kept alive for the process: unloading would pull them from under the engine


def preload(
    sonames: tuple[str, ...] = ENGINE_LIBRARIES + (NCCL_LIBRARY,),
    optional: tuple[str, ...] = OPTIONAL_LIBRARIES,
    dirs: list[Path] | None = None,
) -> LoadReport:
    """Load ``sonames`` globally from the search folders (or the loader's path); report what is missing.

    Call before the engine creates a CUDA session and before CuPy touches NCCL. Loading twice is harmless.
    """
    dirs = search_dirs() if dirs is None else dirs
    report = LoadReport()
    for soname in sonames + optional:
        path = find(soname, dirs)
        try:
            _LOADED[soname] = ctypes.CDLL(str(path) if path else soname, mode=ctypes.RTLD_GLOBAL)
            report.loaded[soname] = str(path) if path else "system"
        except OSError:
            if soname not in optional:
                report.missing.append(soname)
    return report


def gpu_for_local_rank(local_rank: int, local_size: int) -> int:
    """The GPU index (among the visible ones) of a local rank; a clear error when there are too few GPUs.

    Raises:
        RuntimeError: no usable GPU, or more ranks on this host than visible GPUs (NCCL needs one GPU per rank).
    """
    count, why = gpu_count()
    if not count:
        raise RuntimeError(f"distributed.device cuda / use_nccl need a GPU, but {why}; run `ortflow doctor`")
    if local_size > count:
        raise RuntimeError(
            f"{local_size} ranks on this host but only {count} GPU(s) visible: give each rank its own GPU "
            f"(distributed.num_ranks per host <= GPUs) or widen CUDA_VISIBLE_DEVICES"
        )
    return local_rank


def missing_for_ops(op_types, report: LoadReport) -> list[tuple[str, list[str], list[str]]]:
    """(what, the model's ops that need it, its sonames not loaded) for each optional library group ``op_types``
    (a model's op types) needs and ``report`` (:func:`preload`'s) did not load."""
    found = []
    for what, (ops, sonames) in OPTIONAL_FOR_OPS.items():
        used = sorted(set(op_types) & set(ops))
        absent = [soname for soname in sonames if soname not in report.loaded]
        if used and absent:
            found.append((what, used, absent))
    return found


def optional_rows(report: LoadReport) -> list[tuple[str, bool, str]]:
    """``ortflow doctor``'s rows for the optional libraries: found, or which models need them."""
    rows = []
    for what, (ops, sonames) in OPTIONAL_FOR_OPS.items():
        absent = [soname for soname in sonames if soname not in report.loaded]
        detail = (", ".join(report.loaded[s] for s in sonames) if not absent else
                  f"{', '.join(absent)} not found: only models with {'/'.join(ops)} need them (nvidia-cudnn-cu11)")
        rows.append((f"cuDNN {what}", not absent, detail))
    return rows


def diagnose() -> list[tuple[str, bool, str]]:
    """What ``ortflow doctor`` prints: (item, found, detail) for the engine build, CUDA libraries, GPUs, NCCL, MPI."""
    import importlib.metadata as metadata
    import importlib.util
    import shutil

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    rows: list[tuple[str, bool, str]] = []
    gpu_engine, cpu_engine = version("onnxruntime-training"), version("onnxruntime-training-cpu")
    if gpu_engine:
        rows.append(("engine", True, f"onnxruntime-training {gpu_engine} (GPU build: CUDA 11.8, cuDNN 8)"))
    elif cpu_engine:
        rows.append(("engine", True, f"onnxruntime-training-cpu {cpu_engine} (CPU only; for GPUs install "
                                     "onnxruntime-training==1.19.2 instead, see docs/gpu.md)"))
    else:
        rows.append(("engine", False, "no onnxruntime-training build installed"))
    report = preload()
    for soname in ENGINE_LIBRARIES + (NCCL_LIBRARY,):
        where = report.loaded.get(soname)
        rows.append((soname, where is not None, where or "missing: install the `cuda` extra or set " + ENV_DIRS))
    rows += optional_rows(report)
    count, why = gpu_count()
    names, capabilities = gpu_names(count), gpu_capabilities(count)
    listed = ", ".join(f"{i}: {n} (sm_{c[0]}{c[1]})" for i, (n, c) in enumerate(zip(names, capabilities, strict=True)))
    rows.append(("GPUs", count > 0, listed if count else str(why)))
    if (note := jit_note(capabilities)) is not None:
        rows.append(("kernels", True, note))
    cupy = importlib.util.find_spec("cupy")
    rows.append(("CuPy", cupy is not None, "found" if cupy else "missing: needed for use_nccl (the `cuda` extra)"))
    mpi4py = importlib.util.find_spec("mpi4py")
    launcher = Path(sys.executable).parent / "mpiexec"
    launcher_path = str(launcher) if launcher.exists() else shutil.which("mpiexec")
    rows.append(("mpi4py", mpi4py is not None, "found" if mpi4py else "missing"))
    rows.append(("mpiexec", launcher_path is not None, launcher_path or "missing (the mpich wheel brings one)"))
    return rows
