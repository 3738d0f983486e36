"""PyTorch at its best on the bench GPT: the contender ortflow's GPU rows are compared with.

One process per rank (``torchrun --nproc_per_node=N``, or plain ``python`` for one rank). Each process builds every
requested mode from a fresh model (``bench.torch_gpt.GPT``, seed 0, the architecture ortflow's rows train) and warms
it up (compiles it), keeping all of them alive; then ``--rounds`` times a timed window of each mode in turn, so the
modes interleave and a compile is paid once. Rank 0 prints one ``RESULT {json}`` line per mode and round:

* ``eager``: bf16 autocast, the bare model (one rank) or DDP (several);
* ``compile``: the same with ``torch.compile`` of the whole model (one rank) or of the DDP module (DDPOptimizer splits
  the graph at bucket boundaries, so the reduction overlaps the backward);
* ``cudagraphs``: ``torch.compile(mode="reduce-overhead")`` of the whole model, one rank only: inductor's kernels
  replayed as CUDA graphs, so a host slow to launch kernels does not hold the GPU back;
* ``blockcompile``: DDP over a model whose blocks are compiled one by one (DDP's own hooks overlap the reduction);
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block and the root, bf16 parameters and fp32 gradient
  reduction (``MixedPrecisionPolicy``), blocks compiled;
* ``fp32``: strict fp32 (TF32 off), eager, the bare model or DDP: the side note.

Everywhere: fused AdamW (lr 1e-4, eps 1e-8), TF32 on for what stays fp32 (except ``fp32``), batches resident on the
device, the host waiting for each update's loss (as ortflow's loop does). DDP uses ``gradient_as_bucket_view``,
``static_graph`` (not with ``compile``, whose DDPOptimizer builds its own buckets) and the ``bucket_cap_mb`` that
``--bucket-mb`` names, or with ``--tune-buckets`` the fastest of 25/50/100/200 MB on a short eager run.

A window's step time is the median over its timed steps of the slowest rank's (the job's pace). CPU runs (``--device
cpu``, gloo) exist to test this script on tiny shapes: ``--shape tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.torch_gpt import GPT, GPTShape  # noqa: E402 - the path above makes bench importable from any folder

SHAPES = {"bench": {"vocab_size": 8192, "seq_len": 256, "d_model": 768, "num_layers": 12, "num_heads": 12},
          "tiny": {"vocab_size": 64, "seq_len": 16, "d_model": 32, "num_layers": 2, "num_heads": 2}}  # fmt: skip
BATCH = {"bench": 16, "tiny": 4}
MODES = ("eager", "compile", "cudagraphs", "blockcompile", "fsdp2", "fp32")
BUCKETS_MB = (25, 50, 100, 200)


def emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


class Contender:
    """One mode's model and optimizer, kept alive so that its timed windows can interleave with the other modes'."""

    def __init__(self, bench: Bench, mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, info: dict):
        self.bench, self.mode, self.model, self.opt, self.info = bench, mode, model, opt, info
        self.k, self.losses = 0, []

    def steps(self, count: int) -> list[float]:
        """``count`` updates; the wall time of each, the host waiting for its loss (as ortflow's loop does)."""
        bench, times = self.bench, []
        autocast = self.info["autocast_bf16"]
        for _ in range(count):
            chunk = bench.batches[self.k % len(bench.batches)]
            self.k += 1
            start = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            with torch.autocast(bench.device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = self.model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float(), chunk[:, 1:].reshape(-1))
            loss.backward()
            self.opt.step()
            self.losses.append(loss.item())
            times.append(time.perf_counter() - start)
        return times

    def window(self, steps: int, rewarm: int = 0) -> dict:
        """A timed window: the median step of the slowest rank, and the spread on this rank."""
        tf32 = self.info["tf32"]  # each mode's own TF32 setting: the windows of other modes changed it
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        self.steps(rewarm)
        timed = self.steps(steps)
        median = self.bench.slowest(float(np.median(timed)))
        return {**self.info, "step_time_s": median, "spread_s": [float(min(timed)), float(max(timed))],
                "first_loss": self.losses[0], "last_loss": self.losses[-1]}

    def close(self) -> None:
        del self.model, self.opt
        if self.bench.device.type == "cuda":
            torch.cuda.empty_cache()


class Bench:
    """The rank's device, world and batches; :meth:`run` times one mode."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank, self.world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        self.local = int(os.environ.get("LOCAL_RANK", 0))
        self.shape = GPTShape(**SHAPES[args.shape])
        self.batch = args.batch or BATCH[args.shape]
        if args.device == "cuda":
            torch.cuda.set_device(self.local)
            self.device = torch.device("cuda", self.local)
        else:
            self.device = torch.device("cpu")
        if self.world > 1:
            backend = "nccl" if args.device == "cuda" else "gloo"
            kwargs = {"device_id": self.device} if args.device == "cuda" else {}
            dist.init_process_group(backend, rank=self.rank, world_size=self.world, **kwargs)
        gen = torch.Generator().manual_seed(self.rank)
        self.batches = [torch.randint(0, self.shape.vocab_size, (self.batch, self.shape.seq_len + 1), generator=gen)
                        .to(self.device) for _ in range(8)]  # fmt: skip

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def slowest(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a rank that failed inside a collective leaves the others waiting:
        the suite's timeout ends that)."""
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def ddp(self, model: torch.nn.Module, bucket_mb: int, static: bool) -> torch.nn.Module:
        ids = [self.local] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_mb,
                                                         gradient_as_bucket_view=True, static_graph=static)

    def build(self, mode: str, bucket_mb: int) -> tuple[torch.nn.Module, dict]:
        """The wrapped model for ``mode`` and what was chosen (recorded in the result)."""
        tf32 = mode != "fp32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        model = GPT(self.shape, seed=0).to(self.device)
        backend = self.args.compile_backend
        info: dict = {"tf32": tf32, "autocast_bf16": mode not in ("fp32", "fsdp2")}
        if mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            reshard = self.args.fsdp_reshard
            for block in model.h:
                if self.args.fsdp_compile:
                    block.compile(backend=backend)
                fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
            fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
            info.update(wrapper="fully_shard per block + root", param_dtype="bf16", reduce_dtype="fp32",
                        compiled="per block" if self.args.fsdp_compile else "no", reshard_after_forward=reshard)
            return model, info
        if mode == "blockcompile":
            for block in model.h:
                block.compile(backend=backend)
            info["compiled"] = "per block"
        if self.world > 1:
            static = mode != "compile"
            model = self.ddp(model, bucket_mb, static)
            info.update(wrapper="DDP", bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, static_graph=static)
        else:
            info["wrapper"] = "none"
        if mode == "compile":
            model = torch.compile(model, backend=backend)
            info["compiled"] = "whole model" if self.world == 1 else "whole DDP module (DDPOptimizer)"
        if mode == "cudagraphs":
            if self.world > 1:
                raise SystemExit("the cudagraphs mode runs on one GPU only (NCCL calls cannot be captured here)")
            model = torch.compile(model, backend=backend, mode="reduce-overhead")
            info["compiled"] = "whole model, CUDA graphs (mode reduce-overhead)"
        return model, info

    def prepare(self, mode: str, bucket_mb: int, warmup: int) -> Contender:
        """The wrapped model, its optimizer, and ``warmup`` steps (the compile happens here)."""
        model, info = self.build(mode, bucket_mb)
        contender = Contender(self, mode, model, torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8, fused=True),
                              info)  # fmt: skip
        info["optimizer"] = "AdamW fused"
        start = time.perf_counter()
        try:
            contender.steps(1)
        except RuntimeError as err:  # fused AdamW refused (e.g. sharded parameters): the multi-tensor path
            if "fused" not in str(err).lower():
                raise
            contender.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8, foreach=True)
            info["optimizer"] = f"AdamW foreach (fused refused: {str(err)[:200]})"
            contender.steps(1)
        contender.steps(max(0, warmup - 1))
        info["warmup_s"] = round(time.perf_counter() - start, 2)  # compile time, mostly
        try:  # what dynamo compiled so far in this process (cumulative over the modes built before)
            from torch._dynamo.utils import counters

            info["dynamo"] = {group: {k: int(v) for k, v in counters[group].items()} for group in ("frames", "stats")}
            info["dynamo"]["graph_breaks"] = int(sum(counters["graph_break"].values()))
        except (ImportError, AttributeError, KeyError):
            pass
        return contender

    def run(self, mode: str, bucket_mb: int, steps: int, warmup: int) -> dict:
        """One mode alone: warm-up, then one timed window (bucket tuning)."""
        contender = self.prepare(mode, bucket_mb, warmup)
        result = contender.window(steps)
        contender.close()
        return result

    def tune_buckets(self) -> int:
        """The fastest DDP bucket size on a short eager run (one compile-free pass per size)."""
        best, timings = BUCKETS_MB[0], {}
        for mb in BUCKETS_MB:
            timings[mb] = self.run("eager", mb, steps=max(4, self.args.steps // 2), warmup=3)["step_time_s"]
            if timings[mb] < timings[best]:
                best = mb
        if self.rank == 0:
            emit({"kind": "torch-buckets", "world": self.world, "ms_by_bucket_mb": {str(k): round(v * 1e3, 2)
                  for k, v in timings.items()}, "best_mb": best})  # fmt: skip
        return best


def failure(record: dict, err: Exception) -> dict:
    """``record`` marked failed with the error and its traceback."""
    return {**record, "status": "failed", "error": f"{type(err).__name__}: {err}"[-2000:],
            "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="eager,compile", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--batch", type=int, default=0, help="per rank (default: 16 for bench, 4 for tiny)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--bucket-mb", type=int, default=100, help="DDP bucket_cap_mb (without --tune-buckets)")
    parser.add_argument("--tune-buckets", action="store_true", help=f"pick the fastest of {BUCKETS_MB} MB first")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--no-fsdp-compile", dest="fsdp_compile", action="store_false")
    parser.add_argument("--no-fsdp-reshard", dest="fsdp_reshard", action="store_false",
                        help="FSDP2 keeps each block's gathered parameters from forward to backward "
                        "(reshard_after_forward=False: one all-gather per block and step instead of two)")
    parser.add_argument("--rounds", type=int, default=1, help="timed windows per mode, the modes interleaved")
    parser.add_argument("--round", type=int, default=1, help="the number of the first round (recorded)")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    bench = Bench(args)
    if "fsdp2" in modes and bench.world == 1:
        modes.remove("fsdp2")  # sharding over one rank is the bare model: not a row
    bucket = bench.tune_buckets() if args.tune_buckets and bench.world > 1 else args.bucket_mb
    nccl = torch.cuda.nccl.version() if args.device == "cuda" else None
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}  # fmt: skip
    base = {"kind": "torch", "world": bench.world, "batch_per_rank": bench.batch, "shape": args.shape,
            "versions": versions}  # fmt: skip
    contenders = []
    for mode in modes:  # every mode built and warmed up (compiled) first, all kept alive
        try:
            contender, ok = bench.prepare(mode, bucket, args.warmup), True
        except Exception as err:  # noqa: BLE001 - a failing mode is a failed row; the others still run
            contender, ok = None, False
            if bench.rank == 0:
                emit(failure({**base, "mode": mode, "round": args.round}, err))
        if bench.agree(ok):  # a mode that failed on any rank is dropped on all (ranks must run the same modes)
            contenders.append(contender)
        elif contender is not None:
            contender.close()
    for rnd in range(1, args.rounds + 1):  # then the timed windows, the modes interleaved within each round
        for contender in list(contenders):
            if contender.mode == "fp32" and rnd > 1:
                continue  # the strict-fp32 side note: one window
            record = {**base, "mode": contender.mode, "round": args.round + rnd - 1}
            try:
                timed = contender.window(args.steps, rewarm=3 if rnd > 1 else 0)
                record, ok = {**record, **timed, "status": "ok"}, True
            except Exception as err:  # noqa: BLE001 - reported; the mode leaves the later rounds
                record, ok = failure(record, err), False
            if not bench.agree(ok):
                contenders.remove(contender)
                record.setdefault("status", "failed")
                record["status"] = "failed" if not ok else "failed on another rank"
            if bench.rank == 0:
                emit(record)
    if bench.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
