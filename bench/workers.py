"""Processes the benchmark starts: ``python -m bench.workers KIND ...``; each prints one ``BENCH_RESULT {json}``.

* ``bare RUN_DIR``: the bare loop on the run's artifacts and batches: ``module(*inputs); optimizer.step();
  module.lazy_reset_grad()`` and nothing else, where ``optimizer.step()`` is ortflow's update on the engine's buffers
  (the artifacts hold no optimizer graph any more; the batches are read before timing starts).
* ``torch``: the same GPT in PyTorch, DistributedDataParallel over gloo when WORLD_SIZE > 1 (ranks started
  like torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); ``--mode`` eager, ``compile`` (``torch.compile``,
  inductor's C++ backend), ``bf16`` (bf16 autocast) or ``compile-bf16``.
* ``sanity RUN_DIR``: the first losses of the engine (bare loop) and PyTorch from the same initial weights on the same
  batches with the same AdamW, to check that both train the same model.
* ``allreduce MODEL``: under mpiexec, ortflow's ``MPIComm.average_gradients`` on the model's gradient shapes vs a
  bare mpi4py ``Allreduce`` of the same bytes, interleaved.
* ``checkpoint RUN_DIR``: the trainer's checkpoint save (parameters + AdamW moments, fsync, checksum, rename).
* ``gemm``: float32 numpy matmul GFLOP/s with the BLAS threads fixed by the environment.

torch is imported only by ``torch`` and ``sanity``; MPI only by ``allreduce``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import RESULT_TAG

TORCH_MODES = ("eager", "compile", "bf16", "compile-bf16")


def emit(record: dict) -> None:
    """Print the result line the driver parses."""
    print(RESULT_TAG + json.dumps(record), flush=True)


def engine_loop(run_dir: Path, threads: int):
    """The run's config, engine state and module (training mode) and ortflow's update on the engine's buffers
    (``step()``): the parts of the bare loop."""
    from ortflow.config import load_run_config
    from ortflow.engine import api
    from ortflow.trainer.runtime import session_options

    cfg = load_run_config(run_dir)
    art = cfg.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"), device="cpu",
                        session_options=session_options(threads))  # fmt: skip
    module.train()
    return cfg, state, module, _Update(cfg, state)


class _Update:
    """ortflow's update on the engine's buffers behind an ``optimizer.step()`` call, the engine optimizer's interface
    (what the trainer applies)."""

    def __init__(self, cfg, state):
        from ortflow.trainer import optim

        self.names = sorted(n for n, p in state.parameters if p.requires_grad)
        self.grads = [state.parameters[n].grad for n in self.names]
        params = [state.parameters[n].data.reshape(-1) for n in self.names]
        self.update = optim.build_update(cfg.optimizer, optim.whole_segments(self.names, [p.size for p in params]),
                                         params)
        self.lr = cfg.optimizer.learning_rate
        self.state = state

    def step(self) -> None:
        if self.grads[0] is None:  # the engine allocates gradients at the first backward
            self.grads = [self.state.parameters[n].grad for n in self.names]
        self.update.step([g.reshape(-1) for g in self.grads], self.lr)

    def train_state(self):
        from ortflow.checkpoints.h5state import TrainState

        return TrainState(lambda: {n: p.data.copy() for n, p in self.state.parameters}, self.names, self.update,
                          "adamw/torch")


def _batches(cfg, count: int, rank: int = 0, world: int = 1) -> list[dict[str, np.ndarray]]:
    from ortflow.dataprep.loader import TrainLoader

    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, rank, world, prefetch=0)
    return [loader.batch(0, k) for k in range(count)]


def bare(args: argparse.Namespace) -> None:
    cfg, _, module, optimizer = engine_loop(args.run_dir, args.threads)
    batches = _batches(cfg, args.warmup + args.steps)
    names = module.input_names()
    times, losses = [], []
    for feeds in batches:
        t0 = time.perf_counter()
        losses.append(float(module(*(feeds[n] for n in names))))
        optimizer.step()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - t0)
    steady = times[args.warmup :]
    emit({"step_times_s": steady, "step_time_s": float(np.mean(steady)), "world": 1,
          "batch_size": cfg.train.batch_size, "losses": losses[:3]})  # fmt: skip


def _torch_setup(threads: int):
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass
    return torch


def torch_train(args: argparse.Namespace) -> None:
    torch = _torch_setup(args.threads)
    import torch.distributed as dist
    import torch.nn.functional as F

    from bench.common import random_tokens
    from bench.torch_gpt import GPT, GPTShape

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    shape = GPTShape(**json.loads(args.shape))
    model = GPT(shape, seed=0)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
    if "compile" in args.mode:  # inductor's C++ backend on the CPU; compiling happens in the warm-up steps
        model = torch.compile(model)
    # bf16 autocast: matmuls (and what autocast lists) in bf16, parameters, optimizer and loss in fp32.
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if "bf16" in args.mode else contextlib.nullcontext()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    steps = args.warmup + args.steps
    tokens = torch.from_numpy(random_tokens(steps * args.batch_size, shape.seq_len, shape.vocab_size, seed=1 + rank))
    times = []
    for k in range(steps):
        chunk = tokens[k * args.batch_size : (k + 1) * args.batch_size]
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].reshape(-1)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()  # DDP all-reduces the gradient buckets during backward
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    steady = times[args.warmup :]
    mean = float(np.mean(steady))
    if world > 1:  # the job's pace is its slowest rank's
        worst = torch.tensor([mean], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        mean = float(worst[0])
        dist.destroy_process_group()
    if rank == 0:
        emit({"step_times_s": steady, "step_time_s": mean, "world": world, "batch_size": args.batch_size,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "mode": args.mode,
              "first_step_s": times[0]})  # fmt: skip


def sanity(args: argparse.Namespace) -> None:
    torch = _torch_setup(1)
    import torch.nn.functional as F

    from bench.torch_gpt import GPT, GPTShape

    cfg, _, module, optimizer = engine_loop(args.run_dir, 1)
    batches = _batches(cfg, args.steps)
    names = module.input_names()
    engine_losses = []
    for feeds in batches:
        engine_losses.append(float(module(*(feeds[n] for n in names))))
        optimizer.step()
        module.lazy_reset_grad()
    model = GPT(GPTShape(**json.loads(args.shape)), seed=0)
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.epsilon,
                            weight_decay=o.weight_decay)  # fmt: skip
    torch_losses = []
    for feeds in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(torch.from_numpy(feeds["input_ids"])), torch.from_numpy(feeds["labels"]))
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    rel = [abs(a - b) / abs(b) for a, b in zip(engine_losses, torch_losses, strict=True)]
    emit({"engine_losses": engine_losses, "torch_losses": torch_losses, "max_rel_diff": max(rel),
          "first_step_rel_diff": rel[0]})  # fmt: skip


def allreduce(args: argparse.Namespace) -> None:
    import onnx

    from ortflow.trainer.comm import MPIComm

    model = onnx.load(str(args.model), load_external_data=False)
    shapes = [tuple(init.dims) for init in model.graph.initializer if init.data_type == onnx.TensorProto.FLOAT]
    with tempfile.TemporaryDirectory() as tmp:
        comm = MPIComm(Path(tmp) / "hb", 600.0)
        mpi = comm._mpi  # the same library handle: the bare contender must not differ in anything but ortflow
        grads = [np.ones(s, dtype=np.float32) for s in shapes]
        scalars = np.zeros(2, dtype=np.float32)
        flat = np.ones(sum(g.size for g in grads) + scalars.size, dtype=np.float32)
        ours, plain = [], []
        for i in range(args.warmup + args.repeats):
            comm.comm.Barrier()  # start together: time the collective, not the ranks' skew
            t0 = time.perf_counter()
            comm.average_gradients(grads, comm.size, scalars)
            t1 = time.perf_counter()
            comm.comm.Barrier()
            t2 = time.perf_counter()
            comm.comm.Allreduce(mpi.IN_PLACE, flat, op=mpi.SUM)
            t3 = time.perf_counter()
            if i >= args.warmup:
                ours.append(t1 - t0)
                plain.append(t3 - t2)
        comm.close()
    if comm.rank == 0:
        emit({"world": comm.size, "bytes": int(flat.nbytes), "num_tensors": len(grads),
              "ortflow_s": ours, "bare_mpi_s": plain})  # fmt: skip


def checkpoint(args: argparse.Namespace) -> None:
    from ortflow.checkpoints import CheckpointManager
    from ortflow.checkpoints.h5state import write_state

    cfg, state, module, optimizer = engine_loop(args.run_dir, 1)
    feeds = _batches(cfg, 1)[0]
    module(*(feeds[n] for n in module.input_names()))
    optimizer.step()  # the AdamW moments exist only after a step
    times, size = [], 0
    with tempfile.TemporaryDirectory(dir=cfg.output_dir) as tmp:
        manager = CheckpointManager(Path(tmp), period=1, max_num_checkpoints=1, is_writer=True, writer=write_state)
        for step in range(1, args.repeats + 1):
            t0 = time.perf_counter()
            path = manager.save(step, optimizer.train_state(), {"global_cursor": step, "bench": True})
            times.append(time.perf_counter() - t0)
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    emit({"save_s": times, "bytes": size})


def gemm(args: argparse.Namespace) -> None:
    n = args.n
    rng = np.random.default_rng(0)
    a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
    a @ b  # warm-up: BLAS thread start, page faults
    rates = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        a @ b
        rates.append(2 * n**3 / (time.perf_counter() - t0) / 1e9)
    emit({"n": n, "gflops": rates, "threads_env": os.environ.get("OPENBLAS_NUM_THREADS")})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workers")
    sub = parser.add_subparsers(dest="kind", required=True)
    p = sub.add_parser("bare")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.set_defaults(fn=bare)
    p = sub.add_parser("torch")
    p.add_argument("--shape", required=True, help="GPTShape fields as JSON")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mode", choices=TORCH_MODES, default="eager", help="eager, torch.compile, bf16 autocast, both")
    p.set_defaults(fn=torch_train)
    p = sub.add_parser("sanity")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--shape", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.set_defaults(fn=sanity)
    p = sub.add_parser("allreduce")
    p.add_argument("model", type=Path)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.set_defaults(fn=allreduce)
    p = sub.add_parser("checkpoint")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(fn=checkpoint)
    p = sub.add_parser("gemm")
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.set_defaults(fn=gemm)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
