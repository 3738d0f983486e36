"""``python -m bench``: the whole suite on this machine; writes ``bench/out/<host>-<date>.json`` and ``.md``.

Parts, in order: the machine's float32 GEMM ceiling; the "same model" check (first losses, engine vs PyTorch);
the interleaved comparison (ortflow trainer, bare engine loop, PyTorch DDP eager, torch.compile and bf16 autocast
where the CPU has bf16) at 1 x 1, 1 x all cores and N x 1, with ratios against PyTorch's fastest mode and row;
all-reduce (ortflow vs bare MPI) at the largest rank count; checkpoint save time; data preparation
(``python -m bench dataprep``). ``--ranks 1,2,4,8,16`` is the scaling run on a many-core host. The feature
benchmarks are ``python -m bench NAME`` (``bench/__init__.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

from bench import compare
from bench.common import Setup, default_mpiexec, host_info, parse_result, run_command, summarize, thread_env

RESULTS_DIR = Path(__file__).parent / "out"
SHAPE = {"vocab_size": 256, "seq_len": 128, "d_model": 256, "num_layers": 4, "num_heads": 4}
CHECKPOINT_PERIOD = 100  # weight updates between checkpoints: the config's default period


def _say(message: str) -> None:
    print(message, flush=True)


def _worker(setup: Setup, args: list[str], threads: int, logs: Path, name: str, ranks: int = 0) -> dict | None:
    cmd = [setup.python, "-m", "bench.workers", *args]
    if ranks:
        cmd = [*setup.mpiexec, "-n", str(ranks), *cmd]
    code, out, _ = run_command(cmd, {**setup.env, **thread_env(threads)}, 900, logs / f"{name}.log")
    result = parse_result(out) if code == 0 else None
    if result is None:
        _say(f"  {name}: FAILED (exit {code}), see {logs / (name + '.log')}")
    return result


def ceiling(setup: Setup, cores: int, logs: Path) -> dict:
    """float32 GEMM GFLOP/s with 1 BLAS thread and with all cores."""
    one = _worker(setup, ["gemm", "--n", "1024"], 1, logs, "gemm-1thread")
    every = _worker(setup, ["gemm", "--n", "2048", "--repeats", "3"], cores, logs, f"gemm-{cores}threads")
    best = lambda r: max(r["gflops"]) if r else None  # noqa: E731 - best of a few: the ceiling, not the average
    return {"gemm_gflops_1_thread": best(one), f"gemm_gflops_{cores}_threads": best(every),
            "gemm_gflops_all_threads": best(every), "cores": cores}  # fmt: skip


def cpu_has_bf16() -> bool:
    """Whether the CPU has bf16 instructions (AVX512-BF16 or AMX-BF16), where PyTorch's bf16 autocast pays."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def torch_modes(text: str) -> list[str]:
    """The PyTorch modes to run: ``auto`` or a comma list of ``bench.workers.TORCH_MODES``."""
    from bench.workers import TORCH_MODES

    if text == "auto":
        return ["eager", "compile", *(["bf16", "compile-bf16"] if cpu_has_bf16() else [])]
    modes = [m for m in text.split(",") if m]
    unknown = sorted(set(modes) - set(TORCH_MODES))
    if unknown or not modes:
        raise SystemExit(f"--torch-modes {text!r}: use auto or a comma list of {', '.join(TORCH_MODES)}")
    return modes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--ranks", default="1,2", help="rank counts of the N x 1 layouts (1 must be among them)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every contender")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from timing (a multiple of --display)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps (a multiple of --display)")
    parser.add_argument("--display", type=int, default=5, help="trainer progress window, in steps")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step (weak scaling)")
    parser.add_argument("--shape", default=json.dumps(SHAPE), help="GPT shape as JSON")
    parser.add_argument("--mpiexec", default=None, help="launcher prefix (default: $BENCH_MPIEXEC or .venv's mpiexec)")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: dataprep,allreduce,checkpoint,sanity")
    parser.add_argument("--torch-modes", default="auto",
                        help="PyTorch modes, comma list of eager,compile,bf16,compile-bf16 (auto: eager and compile, "
                        "plus bf16 and compile-bf16 where the CPU has bf16 instructions)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the .json, .md and plots")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--name", default=None, help="result file stem (default: <host>-<date>)")
    args = parser.parse_args(argv)

    ranks = sorted({int(r) for r in args.ranks.split(",")})
    if ranks[0] != 1:
        raise SystemExit("--ranks must include 1: efficiencies are relative to 1 rank x 1 thread")
    if args.warmup % args.display or args.steps % args.display:
        raise SystemExit("--warmup and --steps must be multiples of --display (the trainer reports per window)")
    skip = set(filter(None, args.skip.split(",")))
    torch_kinds = [("torch" if m == "eager" else f"torch-{m}") for m in torch_modes(args.torch_modes)]
    cores = len(os.sched_getaffinity(0))
    mpiexec = tuple(shlex.split(args.mpiexec)) if args.mpiexec else default_mpiexec()
    setup = Setup(shape=json.loads(args.shape), batch_size=args.batch_size, warmup_steps=args.warmup,
                  timed_steps=args.steps, display_steps=args.display, mpiexec=mpiexec)  # fmt: skip
    command = "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    name = args.name or f"{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M')}"
    started = time.perf_counter()

    from bench.compare import build
    from bench.torch_gpt import GPTShape

    shape = GPTShape(**setup.shape)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.work or Path(tmp)
        logs = args.out / f"{name}-logs"
        logs.mkdir(parents=True, exist_ok=True)
        _say(f"bench: {command}\n  workload in {root}, logs in {logs}")
        build(root, setup, rows=max(2048, max(ranks) * setup.batch_size * (setup.total_steps + setup.display_steps)))
        record: dict = {"command": command, "host": host_info(), "setup": {**setup.__dict__, "mpiexec": list(mpiexec)},
                        "model": {"shape": shape.as_dict(), "num_params": shape.num_params(),
                                  "train_flops_per_token": shape.train_flops_per_token(),
                                  "tokens_per_step_per_rank": setup.batch_size * shape.seq_len}}  # fmt: skip
        _say("ceiling: float32 GEMM")
        record["ceiling"] = ceiling(setup, cores, logs)
        if "sanity" not in skip:
            _say("sanity: first losses, engine vs PyTorch, same weights and batches")
            record["sanity"] = _worker(setup, ["sanity", str(root / "run"), "--shape", json.dumps(setup.shape)], 1,
                                       logs, "sanity")  # fmt: skip

        contenders = [compare.Contender("ortflow", 1, 1), compare.Contender("bare", 1, 1),
                      *(compare.Contender(k, 1, 1) for k in torch_kinds)]  # fmt: skip
        if cores > 1:
            contenders += [compare.Contender("ortflow", 1, cores),
                           *(compare.Contender(k, 1, cores) for k in torch_kinds)]  # fmt: skip
        for n in ranks[1:]:
            contenders += [compare.Contender("ortflow", n, 1), *(compare.Contender(k, n, 1) for k in torch_kinds)]
        _say(f"compare: {len(contenders)} contenders x {args.rounds} rounds")
        runs = compare.interleaved(contenders, args.rounds, root, setup, logs, progress=_say)
        record["runs"] = runs
        record["summary"] = compare.summarize_runs(runs)
        layouts = sorted({(c.ranks, c.threads) for c in contenders}, key=lambda rt: (rt[0], rt[1]))
        record["ratios"] = {
            "trainer_overhead": compare.overhead(runs),
            "weak_scaling_efficiency": {kind: {str(n): compare.scaling_efficiency(runs, kind, n) for n in ranks[1:]}
                                        for kind in ("ortflow", "torch")},
            "ortflow_over_torch": {f"{r}x{t}": compare.paired_ratio(runs, f"ortflow {r}x{t}", f"torch {r}x{t}")
                                   for r, t in layouts},
            "intra_op_speedup": {kind: compare.paired_ratio(runs, f"{kind} 1x{cores}", f"{kind} 1x1")
                                 for kind in ("ortflow", "torch")} if cores > 1 else {},
            # PyTorch at its best: the fastest mode in each round, per layout and over the layouts using every core.
            "ortflow_over_torch_best_mode": {
                f"{r}x{t}": compare.paired_best_ratio(runs, [f"ortflow {r}x{t}"], [f"{k} {r}x{t}" for k in torch_kinds])
                for r, t in layouts},
            "ortflow_best_over_torch_best_all_cores": compare.paired_best_ratio(
                runs, [f"ortflow {r}x{t}" for r, t in layouts if r * t == cores],
                [f"{k} {r}x{t}" for k in torch_kinds for r, t in layouts if r * t == cores]),
        }  # fmt: skip
        torch_labels = [f"{k} {r}x{t}" for k in torch_kinds for r, t in layouts]
        record["torch_best_row"] = compare.best_label(record["summary"], torch_labels)
        per_core = record["ceiling"]["gemm_gflops_1_thread"]
        record["fraction_of_ceiling"] = {}
        for label, s in record["summary"].items():
            tokens = s["tokens_per_s"]["median"]
            n, t = (int(v) for v in label.split()[1].split("x"))
            if tokens and per_core:
                achieved = tokens * shape.train_flops_per_token() / 1e9
                record["fraction_of_ceiling"][label] = {"gflops": achieved, "cores_used": n * t,
                                                        "fraction": achieved / (per_core * n * t)}  # fmt: skip

        if "allreduce" not in skip and ranks[-1] > 1:
            _say(f"allreduce: ortflow vs bare MPI at {ranks[-1]} ranks")
            r = _worker(setup, ["allreduce", str(root / "gpt.onnx")], 1, logs, "allreduce", ranks=ranks[-1])
            if r:
                r["ortflow"] = summarize(r.pop("ortflow_s"))
                r["bare_mpi"] = summarize(r.pop("bare_mpi_s"))
                r["ratio_median"] = r["ortflow"]["median"] / r["bare_mpi"]["median"]
            record["allreduce"] = r
        if "checkpoint" not in skip:
            _say("checkpoint: trainer's save (parameters + AdamW moments)")
            r = _worker(setup, ["checkpoint", str(root / "run")], 1, logs, "checkpoint")
            step = record["summary"].get("ortflow 1x1", {}).get("step_time_s", {}).get("median")
            if r:
                r["save"] = summarize(r.pop("save_s"))
                r["period_steps"] = CHECKPOINT_PERIOD
                r["step_time_s"] = step
                if step:
                    r["fraction_of_training"] = r["save"]["median"] / (CHECKPOINT_PERIOD * step + r["save"]["median"])
            record["checkpoint"] = r
    if "dataprep" not in skip:
        _say("dataprep: bench.bench_dataprep")
        code, out, _ = run_command([setup.python, "-m", "bench.bench_dataprep"], {}, 900, logs / "dataprep.log")
        path = RESULTS_DIR / "dataprep.json"
        record["dataprep"] = json.loads(path.read_text()) if code == 0 and path.exists() else None
    record["logs"] = str(logs)
    record["load_average_at_end"] = os.getloadavg()
    record["wall_s"] = time.perf_counter() - started

    from bench.report import write_report

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{name}.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    md = write_report(json_path)
    _say(f"wrote {json_path} and {md} in {record['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    from bench import run

    sys.exit(run(sys.argv[1:], main))
