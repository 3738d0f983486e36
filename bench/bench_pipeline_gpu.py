"""Pipeline parallelism on 2 GPUs: pp 2 vs dp 2 on the same 2 GPUs (NCCL), each stage's update time and idle share.

Run on a machine with 2 GPUs and the GPU engine (docs/gpu.md):
``python -m bench pipeline-gpu [--batch-size 16] [--rounds 3] [--steps 6] [--micro 2 8]`` (writes
bench/out/pipeline-gpu-<host>.json and .md, or into --out). The same GPT and the same worker as the CPU bench
(bench/bench_pipeline.py: the trainer's own init_runtime, pipeline_step, NCCL exchange and device update), configured
with ``device: cuda, use_nccl: true``; rounds alternate the contenders. Memory here is each rank's whole GPU as used
after the steps (cudaMemGetInfo: the engine's CUDA arena, NCCL buffers and the CUDA context), for reference: the
CPU bench measures the per-rank memory split.

Bubble: on each stage, idle = 1 - (seconds inside engine calls) / (update seconds), against (P-1)/(m+P-1).
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import sys
import tempfile
from pathlib import Path

from bench.bench_pipeline import ROOT, SHAPE, _configure, _launch
from bench.common import write_result


def summarize(results: dict, micro: list[int]) -> dict:
    """Medians over rounds: samples/s of dp2 and pp2, each stage's update/engine ms and idle share, GPU memory."""
    def med(key: str, pick) -> float:
        return statistics.median(pick(r) for r in results[key])

    rows = {}
    for m in micro:
        row = {kind: med(f"{kind}-m{m}", lambda r: r[0]["samples_per_step"] / max(x["step_s"] for x in r))
               for kind in ("dp2", "pp2")}
        row["pp2_over_dp2"] = row["pp2"] / row["dp2"]
        row["stage_step_ms"] = [1e3 * med(f"pp2-m{m}", lambda r, s=s: r[s]["step_s"]) for s in (0, 1)]
        row["stage_engine_ms"] = [1e3 * med(f"pp2-m{m}", lambda r, s=s: r[s]["compute_s"]) for s in (0, 1)]
        row["idle_stage"] = [med(f"pp2-m{m}", lambda r, s=s: 1 - r[s]["compute_s"] / r[s]["step_s"]) for s in (0, 1)]
        row["bubble_theory"] = 1 / (m + 1)
        rows[m] = row
    first = micro[0]
    memory = {"pp1": results[f"pp1-m{first}"][0][0]["device_memory_used"],
              "dp2 rank 0": results[f"dp2-m{first}"][0][0]["device_memory_used"]}
    memory.update({f"pp2 stage {s}": results[f"pp2-m{first}"][0][s]["device_memory_used"] for s in (0, 1)})
    return {"throughput": rows, "device_memory_used": memory}


def report(record: dict) -> str:
    """The markdown summary written next to the JSON."""
    s = record["summary"]
    lines = [f"# Pipeline bench on 2 GPUs ({record['host']})", "", f"`{record['command']}`", "",
             f"GPT {record['shape']}, micro-batch {record['batch_size']} sequences, `device: cuda`, `use_nccl: true`; "
             f"medians of {record['rounds']} rounds x {record['timed_steps']} timed updates.", "",
             "| m | dp2 samples/s | pp2 samples/s | pp2/dp2 | stage 0 update ms | stage 1 update ms | "
             "stage 0 engine ms | stage 1 engine ms | idle stage 0 | idle stage 1 | (P-1)/(m+P-1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, row in s["throughput"].items():
        lines.append(f"| {m} | {row['dp2']:.1f} | {row['pp2']:.1f} | {row['pp2_over_dp2']:.2f} | "
                     f"{row['stage_step_ms'][0]:.2f} | {row['stage_step_ms'][1]:.2f} | {row['stage_engine_ms'][0]:.2f}"
                     f" | {row['stage_engine_ms'][1]:.2f} | {row['idle_stage'][0]:.2f} | {row['idle_stage'][1]:.2f} | "
                     f"{row['bubble_theory']:.2f} |")
    lines += ["", "GPU memory in use after the steps (MiB, whole device: engine arena + NCCL + CUDA context): "
              + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in s["device_memory_used"].items() if v is not None), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 8], help="micro-batches per update (m)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="folder for the .json/.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-gpu-") as tmp:
        root, b = Path(tmp), args.batch_size
        runs = {("pp1", args.micro[0]): (_configure(root, "pp1", 1, 1, args.micro[0], b, "cuda"), 1)}
        for m in args.micro:
            runs[("dp2", m)] = (_configure(root, f"dp2-m{m}", 2, 1, m, b, "cuda"), 2)
            runs[("pp2", m)] = (_configure(root, f"pp2-m{m}", 2, 2, m, b, "cuda"), 2)
        results: dict = {f"{kind}-m{m}": [] for kind, m in runs}
        for round_ in range(args.rounds):
            for (kind, m), (run_dir, ranks) in runs.items():
                if kind == "pp1" and round_:  # one GPU unsplit: its memory only, once
                    continue
                results[f"{kind}-m{m}"].append(_launch(run_dir, ranks, args.warmup, args.steps))
                print(f"{kind} m={m}: " + ", ".join(f"rank {r['rank']} {r['step_s'] * 1e3:.2f} ms/update"
                                                   for r in results[f"{kind}-m{m}"][-1]), flush=True)
    command = "python -m bench pipeline-gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": command.strip(), "host": socket.gethostname(), "platform": platform.platform(),
              "shape": SHAPE, "batch_size": args.batch_size, "rounds": args.rounds, "timed_steps": args.steps,
              "load_average_1min": os.getloadavg()[0], "summary": summarize(results, args.micro), "raw": results}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"pipeline-gpu-{socket.gethostname()}"
    write_result(out, record, report(record))
    print(report(record))


if __name__ == "__main__":
    main()
