"""Per-operator profiling of chosen weight updates (``train.profile_steps: [start, end]``, ``--profile A:B``).

What onnxruntime-training 1.19.2 allows (checked): profiling is a ``SessionOptions`` flag (``enable_profiling``,
``profile_file_prefix``) read when a session is created, and the training ``Module`` exposes no ``end_profiling``;
the trace file is written when the session is destroyed. So profiling cannot be switched on and off in the trainer's
own session. Instead, for updates ``start..end``, the training calls of each of the rank's engine parts (the whole
model, a pipeline stage, every tensor-parallel piece: :meth:`~ortflow.trainer.rank_model.RankModel.engine_parts`)
run in a second ``Module`` created with profiling on, over the same ``CheckpointState``: it shares the parameters (the
optimizer's updates are seen by both), but allocates its own gradient buffers, so after the update's backward passes
its gradients are copied into the trainer's buffers (the ones the exchange, the tied-weight sums and the optimizer
use). Measured on the CPU build: a run with such an interlude ends with bit-identical parameters to one without.
After ``end`` the second modules are dropped, which writes their Chrome traces; they are merged into
``<run>/profile/rank-<R>.json`` (open it in chrome://tracing or Perfetto). The profiling module has no eval model
(its session would write a second trace under the same name), so the forward-only calls of a pipeline's middle stages
and of tensor-parallel pieces before the last run untraced in the trainer's own eval session.

The traces' reading (the top-operators table the run summary shows) is :mod:`.profile_report`, which the orchestrator
imports without numpy.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from ortflow.trainer.profile_report import PROFILE_DIR, PROFILE_ENV, markdown_table, parse_steps, top_operators

log = logging.getLogger("ortflow.trainer")


class _Timed:
    """A module whose calls are timed (the forward+backward time the table is checked against)."""

    def __init__(self, module: object):
        self.module, self.seconds, self.calls = module, 0.0, 0

    def __call__(self, *inputs):
        start = time.perf_counter()
        out = self.module(*inputs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out

    def __getattr__(self, name: str):  # train(), input_names(), lazy_reset_grad() of the module
        return getattr(self.module, name)


class StepProfiler:
    """Runs updates ``start..end`` (1-based, inclusive) in profiling sessions; a no-op when ``steps`` is None."""

    def __init__(self, model, steps: tuple[int, int] | None):
        self.model, self.steps = model, steps
        self._parts: list[tuple[object, _Timed, dict[str, np.ndarray]]] = []  # (part, its twin, pinned gradients)
        self._kept: list[tuple[int, object]] = []  # (part index, its kept-activation calls in a profiling twin)
        self.trace: Path | None = None
        if steps is not None and model.buffers.on_device:
            raise ValueError("train.profile_steps needs distributed.device cpu (GPU profiling is not wired up yet)")

    @classmethod
    def for_run(cls, model) -> StepProfiler:
        """The profiler the config (or ``ORTFLOW_PROFILE_STEPS``) asks for."""
        override = os.environ.get(PROFILE_ENV)
        steps = parse_steps(override) if override else model.cfg.train.profile_steps
        return cls(model, tuple(steps) if steps else None)

    def begin(self, step: int) -> None:
        """Before update ``step``'s micro-batches: the first profiled update opens a profiling twin of every part."""
        if self.steps is None or self._parts or self._kept or not self.steps[0] <= step <= self.steps[1]:
            return
        self.model.gradient_buffers()  # the trainer's buffers, pinned before the second modules exist
        for index, part in enumerate(self.model.engine_parts()):
            if part.kept is not None:  # its separate forward/backward calls, in a profiling twin of their session
                part.kept.profile(self._options(index))
                self._kept.append((index, part.kept))
                continue
            pinned = {n: p.grad for n, p in part.state.parameters if p.requires_grad}
            twin = _Timed(self._open(part, index))
            part.profiling = twin
            self._parts.append((part, twin, pinned))
        log.info("rank %d profiling updates %d..%d (%d engine part(s))", self.model.comm.rank, *self.steps,
                 len(self._parts) + len(self._kept))

    def _options(self, index: int):
        from ortflow.trainer.startup import available_cores, session_options, spin_wait

        model = self.model
        spin = spin_wait(model.cfg, model.comm.local_size, model.threads, available_cores())
        options = session_options(model.threads, model.cfg.distributed.deterministic_compute, spin)
        options.enable_profiling = True
        options.profile_file_prefix = str(self._folder() / f".rank-{model.comm.rank}-part-{index}")
        return options

    def _open(self, part, index: int):
        from ortflow.engine import api

        # No eval model: its session would write a second trace under the same name.
        module = api.Module(str(part.folder / "training_model.onnx"), part.state, None, device="cpu",
                            session_options=self._options(index))  # fmt: skip
        module.train()
        return module

    def _folder(self) -> Path:
        folder = self.model.run_dir / PROFILE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def after_backward(self, step: int) -> None:
        """On a profiled update: hand its gradients to the trainer's buffers; after the last one, write the traces."""
        if not (self._parts or self._kept) or step < self.steps[0]:
            return
        for part, twin, pinned in self._parts:
            params = part.state.parameters
            for name, mine in pinned.items():
                np.copyto(mine, params[name].grad)  # the profiling module's buffer for this parameter
            twin.module.lazy_reset_grad()
        if step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Drop the profiling sessions (ONNX Runtime writes the traces then) and merge them into this rank's trace."""
        if not (self._parts or self._kept):
            return
        measured = sum(twin.seconds for _, twin, _ in self._parts) + sum(k.seconds for _, k in self._kept)
        calls = sum(twin.calls for _, twin, _ in self._parts) + sum(k.calls for _, k in self._kept)
        indices = sorted([i for i, _ in self._kept] + [i for i, part in enumerate(self.model.engine_parts())
                                                       if part.profiling is not None])
        for part, twin, _ in self._parts:
            part.profiling = None
            twin.module = None  # drop the session itself, which writes the trace
        for _, kept in self._kept:
            kept.unprofile()  # drops the profiling session, which writes the trace
        self._parts, self._kept = [], []
        gc.collect()
        folder, rank = self._folder(), self.model.comm.rank
        traces = []
        for index in indices:  # the largest file of each part is its trace
            written = sorted(folder.glob(f".rank-{rank}-part-{index}_*.json"), key=lambda p: p.stat().st_size)
            traces += written[-1:]
            for extra in written[:-1]:
                extra.unlink(missing_ok=True)
        if not traces:
            log.warning("rank %d: the engine wrote no profile into %s", rank, folder)
            return
        self.trace = folder / f"rank-{rank}.json"
        if len(traces) == 1:
            os.replace(traces[0], self.trace)
        else:  # one trace per part (a stage's pieces): their events in one file
            tmp = folder / f".rank-{rank}.json.tmp"
            tmp.write_text(json.dumps([event for path in traces for event in json.loads(path.read_text())]))
            os.replace(tmp, self.trace)
            for path in traces:
                path.unlink(missing_ok=True)
        meta = {"steps": list(self.steps), "forward_backward_s": measured, "calls": calls}
        (folder / f"rank-{rank}.meta.json").write_text(json.dumps(meta))
        if rank == 0:
            rows = top_operators(self.trace)
            (folder / "top_ops.md").write_text(markdown_table(rows, meta))
            top = markdown_table(rows[:10], meta, kernels_ms=sum(r["total_ms"] for r in rows))
            log.info("profile of updates %d..%d: %s (top %d of %d op types)\n%s", *self.steps, self.trace,
                     min(10, len(rows)), len(rows), top)  # fmt: skip
