"""GPU benchmark: ortflow on 1 and 2 CUDA ranks (NCCL), PyTorch DDP (NCCL) on the same GPT, and all-reduce bandwidth.

Stages (run in this order on a 2-GPU machine, they write ``bench/out/gpu.{json,md}``):

* ``prepare ROOT``: the GPT (``ortflow.examples.gpt.build_gpt``), random tokens, and configured + sharded run folders:
  ``c1``/``c2`` (equivalence: 1 rank at batch 2b vs 2 NCCL ranks at batch b) and ``t1``/``t2`` (throughput, batch B per
  GPU).
* ``steps RUN_DIR`` under mpiexec: the loop's per-update work (forward+backward, NCCL average, AdamW step) timed
  after a warm-up, on in-memory batches so data loading is not measured; prints one JSON line.
* ``allreduce`` under mpiexec -n 2: bus bandwidth of ``NCCLComm.average_gradients`` against a bare CuPy NCCL
  all-reduce on the same buffers, at 16 MB, 256 MB and 1 GB.
* ``grads HEARTBEATS`` under mpiexec: the gradient exchange on buffers shaped like the mixed-precision bench GPT's
  gradients (one allocation per tensor, as the engine's): ``NCCLComm.average_gradients`` one NCCL call per tensor in
  one group (``tensors32``), packed into one float32 buffer (``packed32``), in fp16 (``half16``), each also in
  buckets of ``--bucket-mb`` MB (``half16-b32``: NCCL reduces a bucket while the GPU packs and unpacks the others),
  against one bare all-reduce of the same bytes (``bare32``, ``bare16``); and their parts: the host time to enqueue
  the per-tensor group (``enqueue32``), that group alone (``group32``), the norm's launches (``norm32``), the fp16
  pack and unpack (``pack16``), the host steps without kernels (``host``). Interleaved rounds, a barrier before every
  call; prints one JSON line.
* ``ddp`` under ``torch.distributed.run`` (the machine's own PyTorch): ``bench.torch_gpt.GPT`` of the same shape.
* ``equivalence C1 C2 LOG``: final parameters of the two equivalence runs and the per-rank sha256 lines of C2's log.
* ``report DIR``: collects the JSON files into ``gpu.json`` and ``gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = {"vocab_size": 8192, "seq_len": 128, "d_model": 256, "num_layers": 8, "num_heads": 4}
SMALL = {"vocab_size": 512, "seq_len": 64, "d_model": 128, "num_layers": 2, "num_heads": 4}
BATCH = 32  # per GPU, throughput runs
SIZES_MB = (16, 256, 1024)


def emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def _config(root: Path, name: str, model: Path, data: Path, ranks: int, batch: int, steps: int, period: int):
    from ortflow.config import config_from_dict

    return config_from_dict({
        "name": name, "output_dir": str(root / name),
        "model": {"path": str(model), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(data)], "eval_fraction": 0.0, "rows_per_shard": 4096},
        "train": {"batch_size": batch, "num_train_steps": steps, "display_loss_steps": 5, "evaluation_period": 0},
        "optimizer": {"name": "adamw", "learning_rate": 1e-3},
        "distributed": {"num_ranks": ranks, "device": "cuda", "use_nccl": True},
        "checkpoint": {"period": period, "max_num_checkpoints": 10},
    })  # fmt: skip


def _tokens(path: Path, shape: dict, rows: int, seed: int) -> Path:
    tokens = np.random.default_rng(seed).integers(0, shape["vocab_size"], (rows, shape["seq_len"] + 1), dtype=np.int64)
    np.savez(path, input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    return path


def prepare(args: argparse.Namespace) -> None:
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data
    from ortflow.examples.gpt import build_gpt

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    small, big = build_gpt(root / "small.onnx", **SMALL), build_gpt(root / "gpt.onnx", **SHAPE)
    small_data, big_data = _tokens(root / "small.npz", SMALL, 1024, 1), _tokens(root / "tokens.npz", SHAPE, 4096, 2)
    runs = [_config(root, "c1", small, small_data, 1, 16, 20, 5), _config(root, "c2", small, small_data, 2, 8, 20, 5),
            _config(root, "t1", big, big_data, 1, BATCH, 40, 0), _config(root, "t2", big, big_data, 2, BATCH, 40, 0)]
    for cfg in runs:
        configure(cfg)
        prepare_data(cfg)


def steps(args: argparse.Namespace) -> None:
    """The loop's update without data loading, checkpoints or logging; the job's pace is its slowest rank's."""
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, group = start_mpi(Path(args.run_dir))
    rt = init_runtime(Path(args.run_dir), cfg, group)
    comm = rt.comm  # NCCL on 2 ranks
    rng = np.random.default_rng(comm.rank)
    vocab, seq, batch = SHAPE["vocab_size"], SHAPE["seq_len"], cfg.train.batch_size
    feeds = [(rng.integers(0, vocab, (batch, seq), dtype=np.int64),
              rng.integers(0, vocab, (batch * seq,), dtype=np.int64)) for _ in range(8)]
    grads = rt.gradient_buffers()
    scalars = np.zeros(2, dtype=np.float32)
    times = []
    for k in range(args.warmup + args.steps):
        start = time.perf_counter()
        ids, labels = feeds[k % len(feeds)]
        scalars[0] = float(rt.module(ids, labels))  # inputs in the model's order: input_ids, labels
        mine = rt.exchange.reduce(grads, comm.size, scalars)
        rt.update.step(mine, cfg.optimizer.learning_rate)
        rt.exchange.gather()
        rt.module.lazy_reset_grad()
        times.append(time.perf_counter() - start)
    mean = float(np.mean(times[args.warmup :]))
    worst = float(comm.allreduce_sum(np.array([mean if r == comm.rank else 0.0 for r in range(comm.size)]), "t").max())
    if comm.rank == 0:
        emit({"kind": "ortflow", "world": comm.size, "batch_per_gpu": batch, "step_time_s": worst,
              "step_times_s": times[args.warmup :], "device": rt.device})  # fmt: skip
    comm.close()


def allreduce(args: argparse.Namespace) -> None:
    import cupy as cp
    from cupy.cuda import nccl

    from ortflow.trainer.comm import DeviceBuffer, attach_nccl, create_communicator

    group = create_communicator(Path(args.heartbeats), 600.0, True)
    comm = attach_nccl(group, group.local_rank)
    size, rows = comm.size, []
    scalars = np.zeros(2, dtype=np.float32)
    for mb in SIZES_MB:
        count = mb * 2**20 // 4
        buf = cp.ones(count, dtype=cp.float32)
        grads = [DeviceBuffer(buf.data.ptr, count, "x")]

        def raw(b=buf, n=count):
            comm.comm.allReduce(b.data.ptr, b.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, comm.stream.ptr)
            comm.stream.synchronize()

        def ours(g=grads):
            comm.average_gradients(g, size, scalars)

        result = {"size_mb": mb}
        for name, call in (("raw_nccl", raw), ("ortflow", ours), ("raw_nccl_again", raw)):
            iters = 5 if mb >= 1024 else 20
            for _ in range(3):
                call()
            group.barrier("bw")
            start = time.perf_counter()
            for _ in range(iters):
                call()
            elapsed = (time.perf_counter() - start) / iters
            result[name] = {"time_s": elapsed, "busbw_GBps": 2 * (size - 1) / size * count * 4 / elapsed / 1e9}
        raw_bw = max(result["raw_nccl"]["busbw_GBps"], result["raw_nccl_again"]["busbw_GBps"])
        result["ratio_to_raw"] = result["ortflow"]["busbw_GBps"] / raw_bw
        rows.append(result)
        del buf
    if comm.rank == 0:
        emit({"kind": "allreduce", "world": size, "rows": rows, "nccl_version": nccl.get_version()})
    comm.close()


def grads(args: argparse.Namespace) -> None:
    import cupy as cp
    import onnx
    from cupy.cuda import nccl

    from bench.bench_mixed import SHAPE as GPT
    from ortflow.examples.gpt import build_gpt
    from ortflow.trainer.comm import DeviceBuffer, create_communicator
    from ortflow.trainer.comm.nccl import NCCLComm

    group = create_communicator(Path(args.heartbeats), 600.0, True)
    model = Path(args.heartbeats) / f"gpt-{group.rank}.onnx"
    build_gpt(model, **GPT)
    graph = onnx.load(str(model), load_external_data=False).graph
    counts = [int(np.prod(t.dims)) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    comms = {"tensors32": NCCLComm(group, group.local_rank), "packed32": NCCLComm(group, group.local_rank, packed=True),
             "half16": NCCLComm(group, group.local_rank, "float16")}
    for mb in args.bucket_mb:  # the bucketed exchange (distributed.nccl_bucket_mb): NCCL overlaps the GPU's passes
        comms[f"tensors32-b{mb:g}"] = NCCLComm(group, group.local_rank, bucket_mb=mb)
        comms[f"packed32-b{mb:g}"] = NCCLComm(group, group.local_rank, packed=True, bucket_mb=mb)
        comms[f"half16-b{mb:g}"] = NCCLComm(group, group.local_rank, "float16", bucket_mb=mb)
    tensors32 = comms["tensors32"]
    stream, size = tensors32.stream, group.size
    rng = np.random.default_rng(group.rank)
    arrays = [cp.asarray(rng.standard_normal(n).astype(np.float32) * 1e-3) for n in counts]
    bufs = [DeviceBuffer(a.data.ptr, a.size, str(i)) for i, a in enumerate(arrays)]
    total = sum(counts)
    flat32, flat16 = cp.zeros(total, dtype=cp.float32), cp.zeros(total, dtype=cp.float16)
    scalars = np.zeros(2, dtype=np.float32)

    def bare(flat, kind):
        def call():
            tensors32.comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, kind, nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()
        return call

    def exchange(comm):
        return lambda: comm.average_gradients(bufs, size, scalars)

    def enqueue():
        cp.cuda.runtime.deviceSynchronize()
        start = time.perf_counter()
        nccl.groupStart()
        for b in bufs:
            tensors32.comm.allReduce(b.ptr, b.ptr, b.count, nccl.NCCL_FLOAT32, nccl.NCCL_AVG, stream.ptr)
        nccl.groupEnd()
        elapsed = time.perf_counter() - start
        stream.synchronize()
        return elapsed

    def group32():  # the per-tensor NCCL group alone
        nccl.groupStart()
        for b in bufs:
            tensors32.comm.allReduce(b.ptr, b.ptr, b.count, nccl.NCCL_FLOAT32, nccl.NCCL_AVG, stream.ptr)
        nccl.groupEnd()
        stream.synchronize()

    def norm32():  # the norm's two launches alone
        table = tensors32._tensor_table(bufs)
        partials = tensors32._partials(table)
        tensors32._launch(tensors32._sum_squares, table, partials)
        with stream:
            tensors32._sum_in_order((1,), (256,), (partials, np.int64(partials.size), tensors32._scalars[2:3]))
        stream.synchronize()

    def pack16():  # the fp16 pack and unpack alone
        half = comms["half16"]
        table = half._tensor_table(bufs)
        partials = half._partials(table)
        whole = table.buckets(0)[0]
        half._packed.pack(table, 1.0, half.stream, whole)
        half._packed.unpack(table, 1.0, partials, half.stream, whole)
        half.stream.synchronize()

    def host():  # the exchange's host steps without its kernels: the waits, the scalars in and out, the tables
        cp.cuda.runtime.deviceSynchronize()
        tensors32._scalars.set(np.zeros(8), stream=stream)
        tensors32._tensor_table(bufs)
        group.watched("grads", stream.synchronize)
        tensors32._scalars.get()

    calls = {"bare32": bare(flat32, nccl.NCCL_FLOAT32), "bare16": bare(flat16, nccl.NCCL_FLOAT16),
             **{name: exchange(c) for name, c in comms.items()}, "group32": group32, "norm32": norm32,
             "pack16": pack16, "host": host}
    times: dict[str, list[float]] = {name: [] for name in [*calls, "enqueue32"]}
    for round_ in range(args.rounds):
        order = list(calls) if round_ % 2 == 0 else list(calls)[::-1]
        for name in order:
            for k in range(args.warmup + args.calls):
                group.barrier("grads")
                start = time.perf_counter()
                calls[name]()
                if k >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        for _ in range(args.calls):
            group.barrier("grads")
            times["enqueue32"].append(enqueue())
    mine = np.array([float(np.median(times[n])) for n in times])
    gathered = group.gather_object(mine, "grads")
    if group.rank == 0:
        worst = np.max(np.stack(gathered), axis=0)
        emit({"kind": "grads", "world": size, "tensors": len(counts), "parameters": total,
              "median_s": dict(zip(times, map(float, worst), strict=True)), "nccl_version": nccl.get_version(),
              "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()})
    for comm in comms.values():
        comm.stream.synchronize()
    group.close()


def ddp(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.torch_gpt import GPT, GPTShape

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    model = GPT(GPTShape(**SHAPE), seed=0).cuda()
    if world > 1:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"] + 1), generator=gen).cuda()
               for _ in range(8)]  # fmt: skip
    times = []
    for k in range(args.warmup + args.steps):
        chunk = batches[k % len(batches)]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(chunk[:, :-1]), chunk[:, 1:].reshape(-1))
        loss.backward()  # DDP all-reduces its gradient buckets during backward
        opt.step()
        loss.item()  # the host waits for the update, as ortflow's loop does for its loss
        times.append(time.perf_counter() - start)
    mean = float(np.mean(times[args.warmup :]))
    if world > 1:
        worst = torch.tensor([mean], dtype=torch.float64, device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        mean = float(worst[0])
        dist.destroy_process_group()
    if rank == 0:
        emit({"kind": "ddp", "world": world, "batch_per_gpu": BATCH, "step_time_s": mean, "torch": torch.__version__,
              "step_times_s": times[args.warmup :]})  # fmt: skip


def equivalence(args: argparse.Namespace) -> None:
    from ortflow.checkpoints import list_complete
    from ortflow.config import load_run_config
    from ortflow.engine import api

    def final(run: str) -> dict[str, np.ndarray]:
        cfg = load_run_config(Path(run))
        state = api.CheckpointState.load_checkpoint(str(list_complete(cfg.checkpoints_dir)[-1].path / "checkpoint"))
        return {n: np.array(p.data) for n, p in state.parameters if p.requires_grad}

    one, two = final(args.one), final(args.two)
    diffs = {n: float(np.max(np.abs(one[n] - two[n]))) for n in one}
    rel = {n: diffs[n] / max(float(np.max(np.abs(one[n]))), 1e-12) for n in one}
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", Path(args.log).read_text())
    by_step: dict[int, dict[int, str]] = {}
    for rank, digest, step in found:
        by_step.setdefault(int(step), {})[int(rank)] = digest
    identical = bool(by_step) and all(len(set(d.values())) == 1 and len(d) == 2 for d in by_step.values())
    emit({"kind": "equivalence", "max_abs_diff": max(diffs.values()), "max_rel_diff": max(rel.values()),
          "worst_param": max(diffs, key=diffs.get), "num_params": len(one), "ranks_identical": identical,
          "sha256_by_step": {str(s): d for s, d in sorted(by_step.items())}})  # fmt: skip


def report(args: argparse.Namespace) -> None:
    found: dict[str, dict] = {}
    for path in sorted(Path(args.dir).glob("*.log")):
        for line in path.read_text().splitlines():
            if line.startswith("RESULT ") or "RESULT {" in line:
                found[path.stem] = json.loads(line[line.index("{") :])
    t1, t2 = found.get("ortflow1", {}).get("step_time_s"), found.get("ortflow2", {}).get("step_time_s")
    d1, d2 = found.get("ddp1", {}).get("step_time_s"), found.get("ddp2", {}).get("step_time_s")
    tokens = BATCH * SHAPE["seq_len"]
    summary = {
        "shape": SHAPE, "batch_per_gpu": BATCH, "tokens_per_gpu_step": tokens,
        "ortflow_tokens_per_s": {"1": tokens / t1 if t1 else None, "2": 2 * tokens / t2 if t2 else None},
        "ddp_tokens_per_s": {"1": tokens / d1 if d1 else None, "2": 2 * tokens / d2 if d2 else None},
        "weak_scaling_efficiency": {"ortflow": t1 / t2 if t1 and t2 else None, "ddp": d1 / d2 if d1 and d2 else None},
        "ratio_to_ddp": {"1": d1 / t1 if d1 and t1 else None, "2": d2 / t2 if d2 and t2 else None},
    }
    out = {"summary": summary, "runs": found}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("root")
    p = sub.add_parser("steps")
    p.add_argument("run_dir")
    for q in (p, sub.add_parser("ddp")):
        q.add_argument("--steps", type=int, default=50)
        q.add_argument("--warmup", type=int, default=10)
    sub.add_parser("allreduce").add_argument("heartbeats")
    g = sub.add_parser("grads")
    g.add_argument("heartbeats")
    g.add_argument("--rounds", type=int, default=3)
    g.add_argument("--calls", type=int, default=20)
    g.add_argument("--warmup", type=int, default=3)
    g.add_argument("--bucket-mb", type=lambda v: [float(x) for x in v.split(",") if x], default=[64.0, 32.0, 16.0],
                   help="bucket sizes of the bucketed variants, comma-separated (default 64,32,16)")
    e = sub.add_parser("equivalence")
    for name in ("one", "two", "log"):
        e.add_argument(name)
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("out")
    args = parser.parse_args(argv)
    {"prepare": prepare, "steps": steps, "allreduce": allreduce, "grads": grads, "ddp": ddp, "equivalence": equivalence,
     "report": report}[args.cmd](args)  # fmt: skip


if __name__ == "__main__":
    main()
