"""How a rank is asked to stop (a signal) and how its training loop ended."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopFlag:
    """Set by a signal handler; honoured by every rank at the same weight update."""

    requested: bool = False
    signum: int = 0  # the signal this rank received (0: none; it stops because another rank did)


@dataclass(frozen=True)
class TrainResult:
    """How a rank's loop ended."""

    step: int
    global_cursor: int
    train_loss: float | None
    eval_loss: float | None
    stopped: bool


#: What the engine, its CUDA libraries, CuPy and the host say when an allocation fails, and on which memory.
_OUT_OF_MEMORY = (
    ("CUBLAS_STATUS_ALLOC_FAILED", "GPU"), ("CUDNN_STATUS_ALLOC_FAILED", "GPU"),
    ("cudaErrorMemoryAllocation", "GPU"), ("CUDA failure 2: out of memory", "GPU"),
    ("CUDA error: out of memory", "GPU"), ("OutOfMemoryError", "GPU"), ("Out of memory allocating", "GPU"),
    ("Failed to allocate memory for requested buffer", None), ("std::bad_alloc", "host"), ("MemoryError", "host"),
)  # fmt: skip


def out_of_memory(err: BaseException) -> str | None:
    """The one-line report of a rank that ran out of memory (GPU or host), naming the fixes; ``None`` for any other
    failure.

    The engine raises these as ``RuntimeError`` with a C++ trace in the text (a CUDA library's handle or the arena
    failing to allocate, ``CUBLAS_STATUS_ALLOC_FAILED`` ...): a traceback of that says nothing a user can act on.
    """
    if not isinstance(err, Exception):
        return None
    text = f"{type(err).__name__}: {err}"
    for token, memory in _OUT_OF_MEMORY:
        if token in text:
            if memory is None:  # the arena's message: its device is named only where the engine adds it
                memory = "GPU" if "GPU=" in text or "Cuda" in text or "CUDA" in text else "host"
            fixes = ("a smaller micro-batch (train.batch_size; train.global_batch_size keeps the samples per update), "
                     "optimizer state sharded over the replicas (distributed.zero_stage 1), ")
            fixes += ("mixed precision (precision.use_mixed_precision), or the model split over more GPUs in pipeline "
                      "stages (distributed.pipeline_parallel_size)") if memory == "GPU" else (
                     "fewer ranks per host, or the model split over more ranks in pipeline stages "
                     "(distributed.pipeline_parallel_size)")
            return (f"ran out of {memory} memory ({token}): the model's weights, gradients and optimizer state and "
                    f"one micro-batch's activations do not fit; use {fixes}")
    return None
