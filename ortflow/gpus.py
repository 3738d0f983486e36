"""The GPUs this process may use, from the NVIDIA driver through ``ctypes`` (no CUDA toolkit, no engine): what the
launcher's ``num_ranks: auto`` on CUDA, the ranks' choice of a GPU and ``ortflow doctor`` count."""

from __future__ import annotations

import ctypes


def gpu_count() -> tuple[int, str | None]:
    """(GPUs this process may use, None) from the CUDA driver, honouring CUDA_VISIBLE_DEVICES; (0, reason) if none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "no NVIDIA driver (libcuda.so.1 not found)"
    if (err := cuda.cuInit(0)) != 0:
        return 0, f"the CUDA driver failed to start (cuInit error {err}; CUDA_VISIBLE_DEVICES may hide every GPU)"
    count = ctypes.c_int(0)
    if (err := cuda.cuDeviceGetCount(ctypes.byref(count))) != 0:
        return 0, f"cuDeviceGetCount error {err}"
    return count.value, None if count.value else "the driver sees no GPU (check CUDA_VISIBLE_DEVICES)"


def gpu_names(count: int) -> list[str]:
    """Each visible GPU's name from the driver (empty when there is none)."""
    if not count:
        return []
    cuda = ctypes.CDLL("libcuda.so.1")
    names = []
    for index in range(count):
        device, name = ctypes.c_int(), ctypes.create_string_buffer(128)
        cuda.cuDeviceGet(ctypes.byref(device), index)
        cuda.cuDeviceGetName(name, 128, device)
        names.append(name.value.decode(errors="replace"))
    return names


def gpu_capabilities(count: int) -> list[tuple[int, int]]:
    """Each visible GPU's compute capability (major, minor) from the driver (empty when there is none)."""
    if not count:
        return []
    cuda = ctypes.CDLL("libcuda.so.1")
    found = []
    for index in range(count):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(device), index)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
        found.append((major.value, minor.value))
    return found
