"""The NCCL gradient all-reduce of one packed buffer: float32, or fp16/bf16 (``distributed.allreduce_dtype``, half
the bytes on the wire).

float32 (the packed exchange, ``ORTFLOW_PACKED_ALLREDUCE``): every gradient is copied into one float32 buffer, NCCL
averages it with the op the per-tensor path uses (``ncclAvg``, or a sum when the divisor is not the world size), and
the unpack writes the gradients back times ``1 / divisor`` where needed, with the norm's partial sums. One NCCL call
instead of one per tensor; the per-element arithmetic is the same (the order of the ranks' terms in NCCL's ring
depends on where an element falls in the buffer, so at more than 2 ranks an element may round differently).

fp16/bf16: the engine's gradients stay float32 (its buffers, the update, the norm); only the exchange is in the half
type:

1. one multi-tensor launch packs every gradient, times ``1 / ranks``, into one fp16/bf16 buffer (round to nearest
   even). Pre-scaling by ``1 / ranks`` keeps the sum of the ranks' values no larger than the largest of them, so the
   sum overflows only where a rank's own value did; with fp16 loss scaling that is exactly an fp16 gradient overflow
   (a value beyond 65504 becomes inf), which the existing check sees as a non-finite norm and skips the update on
   every rank. With a power-of-two number of ranks the pre-scale is exact (but for values it pushes below fp16's
   normal range);
2. ``ncclAllReduce`` sums that buffer in place (``ncclFloat16``/``ncclBfloat16``); every rank receives the same bits
   (each element is reduced once and broadcast), so the ranks stay bitwise identical;
3. one launch unpacks into the float32 buffers times ``ranks / divisor`` (the micro-batches and the loss scale:
   powers of two, exact) and writes each chunk's sum of squares, from which the norm is summed in a fixed order as
   in the float32 path (one read of the gradients fewer).

What it costs in accuracy: each rank's gradient is rounded to 11 (fp16) or 8 (bf16) significant bits before the sum,
and the sum rounded again, instead of the float32 average's one rounding (docs/gpu.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from ortflow.trainer.comm.block_sum import BLOCK_SUM_SRC, HALF_SRC

log = logging.getLogger(__name__)
_SRC = BLOCK_SUM_SRC + HALF_SRC + (Path(__file__).parent / "packed_allreduce.cu").read_text()
_THREADS = 256


class PackedAllReduce:
    """The packed buffer and kernels of one :class:`~ortflow.trainer.comm.nccl.NCCLComm`.

    Args:
        cupy: The cupy module.
        nccl: ``cupy.cuda.nccl``.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    """

    def __init__(self, cupy, nccl, dtype: str):
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"distributed.allreduce_dtype: {dtype!r} is not float32, float16 or bfloat16")
        self._cp, self._nccl = cupy, nccl
        self.dtype, self._bf16, self.half = dtype, np.int32(dtype == "bfloat16"), dtype != "float32"
        # NCCL's enum values (nccl.h: ncclFloat16 = 6, ncclBfloat16 = 9, NCCL >= 2.10) where CuPy lacks the name.
        self.nccl_type = (nccl.NCCL_FLOAT32 if not self.half else getattr(nccl, "NCCL_BFLOAT16", 9) if self._bf16
                          else getattr(nccl, "NCCL_FLOAT16", 6))  # fmt: skip
        module = cupy.RawModule(code=_SRC)
        names = ("pack_half", "unpack_half") if self.half else ("pack_f32", "unpack_f32")
        self._pack, self._unpack = (module.get_function(n) for n in names)
        module.compile()
        if self.half:
            log.info("gradient all-reduce in %s, pre-scaled by 1/ranks (distributed.allreduce_dtype)", dtype)
        self._flat = None
        self._key: tuple | None = None
        self._offsets = None

    def _layout(self, table) -> None:
        """The packed buffer and the device offsets of its tensors, made once per gradient list."""
        if self._key != table.key:
            self._offsets = self._cp.asarray(table.offsets)
            kind = self._cp.uint16 if self.half else self._cp.float32
            self._flat = self._cp.empty(max(1, table.total), dtype=kind)
            self._key = table.key

    def pack(self, table, pre: float, stream, bucket) -> None:
        """Launch the pack of one bucket's chunks (times ``pre``) on ``stream``. ``table``: the gradients'
        :class:`~ortflow.trainer.comm.nccl.TensorTable`; ``bucket``: one of its
        :class:`~ortflow.trainer.comm.nccl.Bucket` s."""
        self._layout(table)
        args = (*table.args, np.int32(bucket.first), self._offsets, self._flat, np.float32(pre))
        with stream:
            self._pack((bucket.chunks,), (_THREADS,), args + ((self._bf16,) if self.half else ()))

    def address(self, element: int) -> int:
        """The device address of element ``element`` of the packed buffer (after a pack)."""
        return self._flat.data.ptr + element * self._flat.itemsize

    def unpack(self, table, post: float, partials, stream, bucket) -> None:
        """Launch the unpack of one bucket (times ``post``) and its chunks' sums of squares into ``partials``."""
        self._layout(table)
        args = (*table.args, np.int32(bucket.first), self._offsets, self._flat, np.float32(post))
        with stream:
            self._unpack((bucket.chunks,), (_THREADS,), args + ((self._bf16,) if self.half else ()) + (partials,))
