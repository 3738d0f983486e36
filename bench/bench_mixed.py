"""Mixed-precision benchmark: ortflow fp32 / fp16 / bf16 against PyTorch TF32, bf16 autocast and torch.compile.

The model: ``ortflow.examples.gpt`` with vocab 8192, T 256, d 768, 12 layers, 12 heads (97.8M
parameters); batch 16 x 256 tokens per GPU; AdamW everywhere (PyTorch's fused AdamW; the engine's AdamW graph);
1 and 2 GPUs. The GPU suite (bench/gpu_suite.sh) runs these stages; ``report`` writes ``mixed.json``/``.md``.

Stages:

* ``prepare ROOT``: the ONNX GPT and one configured run per precision (artifacts only: the timed loop feeds
  in-memory batches, so no data stage).
* ``steps RUN_DIR`` under mpiexec: the loop's per-update work (forward+backward, loss scale, NCCL average and norm,
  the skip decision, AdamW) after a warm-up; the world size comes from the launcher.
* ``torch MODE`` under ``torch.distributed.run`` (the machine's PyTorch): ``bench.torch_gpt.GPT`` of the same shape,
  MODE ``tf32`` (TF32 matmuls, fp32 weights), ``bf16`` (bf16 autocast, eager) or ``compile`` (bf16 autocast +
  torch.compile); DDP on 2 GPUs.
* ``report DIR OUT``: medians per contender, ratios and weak scaling, into ``mixed.json`` and ``mixed.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import write_result

SHAPE = {"vocab_size": 8192, "seq_len": 256, "d_model": 768, "num_layers": 12, "num_heads": 12}
BATCH = 16
#: ``prepare --shape tiny --device cpu``: the same stages on CPU ranks in seconds (tests of this script).
TINY = {"vocab_size": 64, "seq_len": 16, "d_model": 32, "num_layers": 2, "num_heads": 2}
PRECISIONS = {"fp32": {}, "fp16": {"use_mixed_precision": True},
              "fp16-softmax16": {"use_mixed_precision": True, "fp32_ops": ["LayerNormalization"]},
              "bf16": {"use_mixed_precision": True, "use_bfloat16": True},
              "bf16-softmax16": {"use_mixed_precision": True, "use_bfloat16": True,
                                 "fp32_ops": ["LayerNormalization"]}}  # fmt: skip
#: Variants, as suffixes of a precision's name (combinable, e.g. fp16-plainreduce-allreduce16), and what each sets
#: in the distributed section: without the engine's deterministic kernels (their cost); with the engine's own
#: ReduceSum instead of ortflow's MatMul rewrite of the training graph (graph/gradients/leading_sums.py); the NCCL
#: gradient all-reduce in fp16 or bf16 (comm/packed_allreduce.py); the model's GELUs as exported (model.fuse_gelu off,
#: graph/exports/gelu.py); bf16 with its fused GELUs kept in fp32 (``patch``: :func:`_patched`); bf16 with the attention
#: Softmax in fp32, the whole default fp32 list (``-smx32``; bf16's own default computes it in bf16); the float32
#: all-reduce packed into one buffer (``env``: set by ``steps``); the NCCL exchange in one bucket (``-b0``) or
#: buckets of 16 or 64 MB (``-b16``, ``-b64``; distributed.nccl_bucket_mb); the training call replayed as a CUDA graph
#: (``-graphs``; distributed.cuda_graphs). Keys are config sections.
VARIANTS = {"-nondet": {"distributed": {"deterministic_compute": False}},
            "-plainreduce": {"distributed": {"reduce_sum_as_matmul": False}},
            "-allreduce16": {"distributed": {"allreduce_dtype": "float16"}},
            "-allreduce32": {"distributed": {"allreduce_dtype": "float32"}},
            "-allreducebf16": {"distributed": {"allreduce_dtype": "bfloat16"}},
            "-nofuse": {"model": {"fuse_gelu": False}},
            "-zero1": {"distributed": {"zero_stage": 1}},
            "-gelu32": {"patch": {"gelu": "fp32"}},
            "-smx32": {"precision": {"fp32_ops_without": []}},
            "-packed": {"env": {"ORTFLOW_PACKED_ALLREDUCE": "1"}},
            "-b0": {"distributed": {"nccl_bucket_mb": 0}},
            "-b16": {"distributed": {"nccl_bucket_mb": 16}},
            "-b64": {"distributed": {"nccl_bucket_mb": 64}},
            "-graphs": {"distributed": {"cuda_graphs": True}}}


def variant(name: str) -> tuple[str, dict]:
    """(base precision, {section: settings}) of a precision name such as ``fp16-plainreduce``."""
    settings, base = {"distributed": {}, "model": {}, "patch": {}, "env": {}, "precision": {}}, name
    while any(base.endswith(suffix) for suffix in VARIANTS):
        suffix = next(s for s in VARIANTS if base.endswith(s))
        for section, values in VARIANTS[suffix].items():
            settings[section].update(values)
        base = base.removesuffix(suffix)
    if base not in PRECISIONS:
        raise SystemExit(f"unknown precision {name!r}: one of {sorted(PRECISIONS)} plus suffixes {sorted(VARIANTS)}")
    return base, settings


def emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def prepare(args: argparse.Namespace) -> None:
    from ortflow.config import config_from_dict
    from ortflow.configure.configure import configure
    from ortflow.examples.gpt import build_gpt

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    shape, batch = (SHAPE, BATCH) if args.shape == "bench" else (TINY, 4)
    saved = {"shape": shape, "batch": batch}
    model = root / "gpt.onnx"
    reuse = args.reuse_model and model.exists() and (root / "shape.json").exists()
    if reuse and json.loads((root / "shape.json").read_text()) != saved:
        raise SystemExit(f"--reuse-model: {root} holds a GPT of another shape; prepare it again without the flag")
    if not reuse:  # --reuse-model: several configures of one model may run side by side
        build_gpt(model, **shape)
        (root / "shape.json").write_text(json.dumps(saved))
    cuda = args.device == "cuda"
    for name in [n for n in args.precisions.split(",") if n]:
        start, (base, variant_settings) = time.perf_counter(), variant(name)
        with _patched(variant_settings["patch"]):
            _configure(configure, config_from_dict, root, name, model, batch, args.device, cuda, base,
                       variant_settings)
        print(f"configured {name} in {time.perf_counter() - start:.1f} s", flush=True)


def _patched(patch: dict):
    """``-gelu32``: bf16 runs with their fused GELUs kept in fp32 between two casts (the default leaves them bf16)."""
    import contextlib
    from unittest import mock

    if not patch.get("gelu"):
        return contextlib.nullcontext()
    extra = ("Gelu", "FastGelu", "BiasGelu")
    return mock.patch("ortflow.configure.mixed_precision.BF16_FP32_OPS", ("LayerNormalization", *extra))


def _configure(configure, config_from_dict, root, name, model, batch, device, cuda, base, variant_settings):
    configure(config_from_dict({
        "name": name, "output_dir": str(root / name),
        "model": {"path": str(model), "loss": "cross_entropy", **variant_settings["model"]},
        "data": {"train": [str(root / "unused.npz")]},
        "train": {"batch_size": batch, "num_train_steps": 100},
        "optimizer": {"name": "adamw", "learning_rate": 1e-4},
        "distributed": {"num_ranks": 1, "device": device, "use_nccl": cuda, **variant_settings["distributed"]},
        "precision": _precision(base, variant_settings["precision"]),
    }))  # fmt: skip


def _precision(base: str, changes: dict) -> dict:
    """The precision section of ``base`` with a variant's changes (``fp32_ops_without``: the default fp32 list less
    those ops)."""
    from ortflow.graph.precision.autocast import DEFAULT_FP32_OPS

    section = {**PRECISIONS[base], **{k: v for k, v in changes.items() if k != "fp32_ops_without"}}
    if "fp32_ops_without" in changes:  # set explicitly, so bf16 keeps exactly this list
        section["fp32_ops"] = [op for op in DEFAULT_FP32_OPS if op not in changes["fp32_ops_without"]]
    return section


def steps(args: argparse.Namespace) -> None:
    """The loop's update without data loading, checkpoints or logging; the job's pace is its slowest rank's."""
    from ortflow.trainer.runtime import init_runtime, start_mpi

    os.environ.update(variant(Path(args.run_dir).name)[1]["env"])
    cfg, group = start_mpi(Path(args.run_dir))
    cfg = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"num_ranks": group.size})})
    rt = init_runtime(Path(args.run_dir), cfg, group)
    comm, scaler = rt.comm, rt.loss_scale
    rng = np.random.default_rng(comm.rank)
    saved = json.loads((Path(args.run_dir).parent / "shape.json").read_text())
    vocab, seq, batch = saved["shape"]["vocab_size"], saved["shape"]["seq_len"], saved["batch"]
    batches = []
    for _ in range(8 if args.tokens == "uniform" else args.warmup + args.steps):
        tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int64) if args.tokens == "uniform" else \
            _markov(rng, vocab, batch, seq + 1)
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].reshape(-1)})
    grads, scalars, times, losses, forward = [], np.zeros(2, dtype=np.float32), [], [], []
    for k in range(args.warmup + args.steps):
        start = time.perf_counter()
        feeds = scaler.feed(batches[k % len(batches)])
        loss = rt.body.micro_step(feeds)  # the loop's training call (a CUDA graph replay with -graphs)
        forward.append(time.perf_counter() - start)
        grads = grads or rt.gradient_buffers()
        scalars[0] = loss / scaler.scale
        mine = rt.exchange.reduce(grads, comm.size * scaler.scale, scalars)  # as the loop: ortflow's exchange
        norm = rt.exchange.norm(mine) if scaler.needs_norm else None
        if scaler.update(norm):
            rt.update.step(mine, args.lr)  # ortflow's update (fused device kernels on CUDA)
        rt.exchange.gather()
        rt.body.after_update()  # the engine's gradient sums start again
        times.append(time.perf_counter() - start)
        losses.append(float(scalars[0]) / comm.size)
    median = float(np.median(times[args.warmup :]))
    fb = float(np.median(forward[args.warmup :]))
    update = _update_time(rt, mine, args.update_repeats)  # after the timed steps, so they are not slowed by syncs
    mine_stats = np.array([median if r == comm.rank else 0.0 for r in range(comm.size)]
                          + [update if r == comm.rank else 0.0 for r in range(comm.size)]
                          + [fb if r == comm.rank else 0.0 for r in range(comm.size)])
    stats = comm.allreduce_sum(mine_stats, "t")
    state = rt.update.state_bytes
    state = state() if callable(state) else state
    if comm.rank == 0:
        emit({"kind": "ortflow", "precision": Path(args.run_dir).name, "world": comm.size,
              "step_time_s": float(stats[: comm.size].max()), "spread_s": [float(min(times[args.warmup :])),
              float(max(times[args.warmup :]))], "update_time_s": float(stats[comm.size : 2 * comm.size].max()),
              "optimizer_state_mib_per_gpu": round(int(state) / 2**20, 1), "zero_stage": cfg.distributed.zero_stage,
              "forward_backward_s": float(stats[2 * comm.size :].max()), "losses": losses,
              "per_rank": {"step_s": [float(v) for v in stats[: comm.size]],
                           "forward_backward_s": [float(v) for v in stats[2 * comm.size :]]},
              "skipped_updates": scaler.skipped_updates, "loss_scale": scaler.scale, "device": rt.device})  # fmt: skip
    comm.close()


#: ``--tokens markov``: each token is followed by one of 4 successors (fixed per token, the same table on every rank)
#: with probabilities 0.4 / 0.3 / 0.2 / 0.1, so the loss can fall from ln(vocab) to the chain's entropy (1.28 nats).
MARKOV_P = np.array([0.4, 0.3, 0.2, 0.1])


def _markov(rng: np.random.Generator, vocab: int, rows: int, length: int) -> np.ndarray:
    successors = np.random.default_rng(0).integers(0, vocab, (vocab, MARKOV_P.size))
    tokens = np.empty((rows, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, vocab, rows)
    for t in range(1, length):
        tokens[:, t] = successors[tokens[:, t - 1], rng.choice(MARKOV_P.size, rows, p=MARKOV_P)]
    return tokens


def _update_time(rt, mine, repeats: int) -> float:
    """Median wall time of the update alone (this rank's share under ZeRO-1), the device synchronised around it."""
    if repeats <= 0:
        return float("nan")
    def sync() -> None:
        return None

    if rt.device == "cuda":
        import cupy as cp

        sync = cp.cuda.runtime.deviceSynchronize
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        rt.update.step(mine, 1e-4)
        sync()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def torch_run(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.torch_gpt import GPT, GPTShape

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    torch.backends.cuda.matmul.allow_tf32 = True  # what PyTorch users run: TF32 for whatever stays fp32
    torch.backends.cudnn.allow_tf32 = True
    model = GPT(GPTShape(**SHAPE), seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8, fused=True)
    if args.mode == "compile":
        model = torch.compile(model)
    if world > 1:
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"] + 1), generator=gen).cuda()
               for _ in range(8)]  # fmt: skip
    autocast = args.mode in ("bf16", "compile")
    times, losses = [], []
    for k in range(args.warmup + args.steps):
        chunk = batches[k % len(batches)]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(chunk[:, :-1]).float(), chunk[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())  # the host waits for the update, as ortflow's loop does for its loss
        times.append(time.perf_counter() - start)
    median = float(np.median(times[args.warmup :]))
    if world > 1:
        worst = torch.tensor([median], dtype=torch.float64, device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        median = float(worst[0])
        dist.destroy_process_group()
    if rank == 0:
        emit({"kind": "torch", "precision": args.mode, "world": world, "step_time_s": median, "losses": losses,
              "torch": torch.__version__})  # fmt: skip


LABELS = {("ortflow", "fp32"): "ortflow fp32 (TF32 matmuls)", ("ortflow", "fp16"): "ortflow fp16 mixed",
          ("ortflow", "fp16-softmax16"): "ortflow fp16 mixed, Softmax in fp16",
          ("ortflow", "bf16"): "ortflow bf16 mixed",
          ("ortflow", "bf16-softmax16"): "ortflow bf16 mixed, Softmax in bf16", ("torch", "tf32"): "PyTorch TF32 eager",
          ("torch", "bf16"): "PyTorch bf16 autocast eager", ("torch", "compile"): "PyTorch bf16 autocast + compile"}
_VARIANT_WORDS = {"-nondet": "deterministic_compute off", "-plainreduce": "engine ReduceSum (no MatMul rewrite)",
                  "-allreduce16": "fp16 all-reduce", "-allreduce32": "fp32 all-reduce",
                  "-allreducebf16": "bf16 all-reduce",
                  "-nofuse": "GELU as exported (no fusion)", "-zero1": "ZeRO-1", "-gelu32": "fused GELU in fp32",
                  "-smx32": "Softmax in fp32", "-packed": "packed fp32 all-reduce",
                  "-b0": "exchange in one bucket", "-b16": "exchange in 16 MB buckets",
                  "-b64": "exchange in 64 MB buckets"}


def variant_base(prec: str) -> str:
    """``fp16`` for ``fp16-plainreduce``: the name without its last variant suffix (the run it is compared with)."""
    return next((prec.removesuffix(s) for s in VARIANTS if prec.endswith(s)), prec)


def label(kind: str, prec: str) -> str:
    """The table's name for a contender; variants spelled out after the base precision's label."""
    if (kind, prec) in LABELS or kind != "ortflow":
        return LABELS.get((kind, prec), f"{kind} {prec}")
    base, words = prec, []
    while any(base.endswith(s) for s in _VARIANT_WORDS):
        suffix = next(s for s in _VARIANT_WORDS if base.endswith(s))
        words.insert(0, _VARIANT_WORDS[suffix])
        base = base.removesuffix(suffix)
    return ", ".join([LABELS.get(("ortflow", base), f"ortflow {base}"), *words])


def report(args: argparse.Namespace) -> None:
    runs: dict[tuple[str, str, int], dict] = {}
    for path in sorted(Path(args.dir).glob("*.log")):
        for line in path.read_text().splitlines():
            if "RESULT {" in line and '"kind"' in line:
                r = json.loads(line[line.index("{") :])
                runs[(r["kind"], r["precision"], r["world"])] = r
    ms = {key: r["step_time_s"] * 1e3 for key, r in runs.items()}
    rows = ["| contender | 1 GPU ms/update | 2 GPUs ms/update | weak scaling |", "|---|---|---|---|"]
    contenders = list(dict.fromkeys([*LABELS, *sorted({k[:2] for k in ms})]))
    for kind, prec in contenders:
        one, two = ms.get((kind, prec, 1)), ms.get((kind, prec, 2))
        if not (one or two):
            continue
        cells = [f"{v:.1f}" if v else "-" for v in (one, two)]
        rows.append(f"| {label(kind, prec)} | {cells[0]} | {cells[1]} | {f'{one / two:.2f}' if one and two else '-'} |")
    ratios = {}
    for world in (1, 2):
        base = ms.get(("ortflow", "fp32", world))
        for prec in sorted({k[1] for k in ms if k[0] == "ortflow" and k[1] != "fp32"}):
            mine = ms.get(("ortflow", prec, world))
            if not mine:
                continue
            for key, name in ((("ortflow", "fp32"), "ortflow_fp32"), (("torch", "bf16"), "torch_bf16_eager"),
                              (("torch", "compile"), "torch_compile"), (("torch", "tf32"), "torch_tf32")):
                other = ms.get((*key, world)) if key != ("ortflow", "fp32") else base
                if other:
                    ratios[f"{world}gpu {prec} speedup vs {name}"] = round(other / mine, 3)
    for (kind, prec, world), mine in sorted(ms.items()):  # the variants against their base, side by side
        if kind != "ortflow" or prec == (base := variant_base(prec)) or (kind, base, world) not in ms:
            continue
        ratios[f"{world}gpu {base} time ratio {prec}/{base}"] = round(mine / ms[(kind, base, world)], 3)
    summary = {"shape": SHAPE, "batch_per_gpu": BATCH, "ms_per_update": {f"{k[0]} {k[1]} x{k[2]}": round(v, 2)
               for k, v in ms.items()}, "ratios": ratios}  # fmt: skip
    table = "\n".join(rows) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in ratios.items()) + "\n"
    write_result(Path(args.out) / "mixed", {"summary": summary, "runs": {" ".join(map(str, k)): r
                                                                         for k, r in runs.items()}},
                 "# Mixed precision on GPUs\n\n" + table)  # fmt: skip
    print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("root")
    p.add_argument("--precisions", default="fp32,fp16,fp16-softmax16,bf16",
                   help=f"comma-separated; a base precision ({', '.join(PRECISIONS)}) with optional variant "
                   f"suffixes ({', '.join(VARIANTS)})")  # fmt: skip
    p.add_argument("--shape", choices=["bench", "tiny"], default="bench")
    p.add_argument("--reuse-model", action="store_true", help="configure the GPT an earlier prepare wrote")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s = sub.add_parser("steps")
    s.add_argument("run_dir")
    t = sub.add_parser("torch")
    t.add_argument("mode", choices=["tf32", "bf16", "compile"])
    s.add_argument("--update-repeats", type=int, default=10, help="timed update-only calls after the steps")
    s.add_argument("--tokens", choices=["uniform", "markov"], default="uniform",
                   help="uniform: 8 batches of random tokens (speed); markov: a fresh batch per step from a fixed "
                   "4-successor chain, so the loss curve shows learning (convergence comparisons)")
    s.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate (constant)")
    for q in (s, t):
        q.add_argument("--steps", type=int, default=20)
        q.add_argument("--warmup", type=int, default=10)
    r = sub.add_parser("report")
    r.add_argument("dir")
    r.add_argument("out")
    args = parser.parse_args(argv)
    {"prepare": prepare, "steps": steps, "torch": torch_run, "report": report}[args.cmd](args)


if __name__ == "__main__":
    main()
