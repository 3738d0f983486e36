"""CUDA helpers the comm and update kernel modules start with, as source text for NVRTC: the block reduction
(block_sum.cu) and the fp16/bf16 conversions (half.cu)."""

from pathlib import Path

#: ``__device__ double block_sum(double)``: prepended to a module's source (NVRTC has no include path here).
BLOCK_SUM_SRC = (Path(__file__).parent / "block_sum.cu").read_text()

#: ``to_half(float, int bf16)`` and ``from_half(unsigned short, int bf16)``: round to nearest even, by PTX (fp16) or by
#: bits (bf16).
HALF_SRC = (Path(__file__).parent / "half.cu").read_text()
