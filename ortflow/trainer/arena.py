"""One engine memory arena per CPU rank, its first chunk sized for the gradients: they then lie back to back.

The engine allocates its gradient buffers from its CPU arena when the training session is created. A session's own
arena starts small and grows by doubling, so the gradients land in several regions: the bench GPT's 69 gradients
(13.3 MB) in 5 runs of memory. The exchange all-reduces each run in place as one collective (comm/memory_runs.py), and 5
collectives cost about 1.26x one of the same bytes (bench/bench_exchange.py, ``bare-runs``). A process-wide arena (the
engine's environment allocator, ``session.use_env_allocators``) whose first chunk holds every gradient places them
in one run (measured: 1 run with a first chunk of 14 MB, 2 runs with 13 MB), so the exchange is one in-place
all-reduce of the gradients' own memory. It is also shared by the training and eval sessions, as pipeline stages do
(parallel/pipeline_stage.py), instead of one arena each.
"""

from __future__ import annotations

import logging

import onnxruntime

log = logging.getLogger(__name__)

#: The first chunk this process's shared arena was made with (0: not made yet); the engine keeps one per process.
_FIRST_CHUNK: list[int] = []


#: The engine's arena settings are C ints: a first chunk of 2 GiB or more cannot be asked for (a model past 0.5B fp32
#: parameters). The gradients then fill the largest chunk and the arena's next ones: a few runs, still one collective
#: per run (comm/memory_runs.py).
MAX_FIRST_CHUNK = 2**31 - 2**20


def first_chunk_bytes(gradient_bytes: int) -> int:
    """Room for every gradient twice over plus 1 MiB, rounded up to MiB, at most :data:`MAX_FIRST_CHUNK`.

    The engine allocates more than the gradients in the arena while it creates the session, among them (measured): a
    classifier with a 4 MB weight among 4.7 MB of gradients needed a first chunk of about 1.5x the gradients to hold
    them in one run. What the gradients leave of the chunk serves the engine's later allocations, so the room is not
    lost; the chunk is address space until touched.
    """
    want = 2 * gradient_bytes + 2**20
    return min(-(-want // 2**20) * 2**20, MAX_FIRST_CHUNK)


def use_gradient_arena(options: onnxruntime.SessionOptions, gradient_bytes: int) -> onnxruntime.SessionOptions:
    """Make ``options`` allocate from this process's shared CPU arena, created on the first call with a first chunk
    that holds ``gradient_bytes`` (later calls reuse it, whatever their size)."""
    if not _FIRST_CHUNK:
        chunk = first_chunk_bytes(gradient_bytes)
        info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                         onnxruntime.OrtMemType.DEFAULT)  # fmt: skip
        # kNextPowerOfTwo (0) as the engine's default arena grows; the first chunk is what differs.
        config = onnxruntime.OrtArenaCfg({"initial_chunk_size_bytes": chunk, "arena_extend_strategy": 0})
        try:
            onnxruntime.create_and_register_allocator(info, config)
        except Exception as err:  # noqa: BLE001 - the engine raises its own Fail: one shared arena exists already
            # (a pipeline stage's, pipeline_stage.py): use it; the gradients may then lie in a few runs, still correct
            log.debug("shared engine arena exists already (%s); the gradients may lie in several runs", err)
        _FIRST_CHUNK.append(chunk)
        log.debug("shared engine arena: first chunk %d MiB for %d MiB of gradients", chunk >> 20, gradient_bytes >> 20)
    options.add_session_config_entry("session.use_env_allocators", "1")
    return options


#: Whether this process's stage arena was made (the engine keeps one environment allocator per process).
_STAGE_ARENA: list[bool] = []


def use_stage_arena(options: onnxruntime.SessionOptions) -> onnxruntime.SessionOptions:
    """Make ``options`` allocate from one CPU arena for a rank's sessions, grown as requested, without memory
    patterns.

    A pipeline stage runs two sessions every micro-batch (the eval model's forward, the training model's recompute +
    backward), so what one frees the other must be able to reuse. Measured on the bench GPT at 32 sequences per
    micro-batch (``python -m bench.pipeline_memory``, peak RSS growth of stage 0's eval forward + training call; the
    training call alone: 70 MiB): an arena per session (the engine's default) 186 MiB; one shared arena 97 MiB,
    because each session's memory pattern asks for one block of its whole plan and the eval plan's freed block cannot
    hold the training plan; one shared arena without memory patterns, extended by what is requested instead of the
    next power of two (which alone gave 136 MiB for the training call by itself), 72 MiB, the training call's own
    working set. The price: about 4% more CPU per call at 4 sequences (per-tensor allocations), none measurable at 32.
    """
    if not _STAGE_ARENA:
        info = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                         onnxruntime.OrtMemType.DEFAULT)
        # OrtArenaCfg(max_mem, arena_extend_strategy, initial_chunk_size_bytes, max_dead_bytes_per_chunk):
        # 0 / -1 keep the engine's defaults; strategy 1 = kSameAsRequested.
        onnxruntime.create_and_register_allocator(info, onnxruntime.OrtArenaCfg(0, 1, -1, -1))
        _STAGE_ARENA.append(True)
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.enable_mem_pattern = False
    return options


#: The GPU whose stage arena this process made (the engine keeps one environment allocator per device and process).
_DEVICE_ARENA: list[int] = []


def use_device_stage_arena(options: onnxruntime.SessionOptions, device_index: int) -> onnxruntime.SessionOptions:
    """Make ``options`` allocate from one CUDA arena on GPU ``device_index`` for all of a rank's stage and piece
    sessions, grown as requested, without memory patterns (as :func:`use_stage_arena` on the CPU).

    Each session otherwise gets the CUDA provider's own arena, which keeps the peak of that session's calls, so a rank
    holds the sum of its sessions' peaks; a tensor-parallel rank runs two sessions per piece. Measured on an H200 with
    six training Modules of a 110M-parameter GPT (d 1024, 8 layers), one training and one eval call each, one after
    another: 30.2 GiB of GPU memory with an arena each, 28.7 GiB with an arena each and no memory patterns, 15.9 GiB
    with this shared arena (parameters and gradients alone: 4.9 GiB). The shared arena does not reuse everything one
    Module's calls freed for the next (about 1.6 GiB per Module beyond its parameters and gradients here), so a rank
    of many large pieces still grows (the 1.12B Llama at tp 2, its pieces recomputing, peaks at 96.3 GiB with 47
    pieces per rank, ``docs/gpu.md``). The arena's other settings change little on the six Modules: power-of-two
    growth 16.2 GiB, ``max_dead_bytes_per_chunk`` 1 MiB 15.9 GiB, a shrink of the arena after each Module's calls
    14.9 GiB.
    """
    if not _DEVICE_ARENA:
        info = onnxruntime.OrtMemoryInfo("Cuda", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_index,
                                         onnxruntime.OrtMemType.DEFAULT)
        onnxruntime.create_and_register_allocator_v2("CUDAExecutionProvider", info, {"device_id": str(device_index)},
                                                     onnxruntime.OrtArenaCfg(0, 1, -1, -1))
        _DEVICE_ARENA.append(device_index)
    elif _DEVICE_ARENA[0] != device_index:
        raise RuntimeError(f"this process's stage arena is on GPU {_DEVICE_ARENA[0]}, not {device_index}: a rank "
                           "trains on one GPU")
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.enable_mem_pattern = False
    return options
