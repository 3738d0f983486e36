"""The CUDA block reduction the comm kernel modules start with (block_sum.cu), as source text for NVRTC."""

from pathlib import Path

#: ``__device__ double block_sum(double)``: prepended to a module's source (NVRTC has no include path here).
BLOCK_SUM_SRC = (Path(__file__).parent / "block_sum.cu").read_text()
