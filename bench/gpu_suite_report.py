"""The GPU suite's report: ``gpu-suite.json`` (everything) and ``gpu-suite.md`` (the tables), from the suite's rows."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

TORCH_LABELS = {"eager": "PyTorch bf16 autocast, eager", "compile": "PyTorch bf16 autocast + torch.compile",
                "blockcompile": "PyTorch bf16 autocast, blocks compiled",
                "fsdp2": "PyTorch FSDP2 bf16, blocks compiled",
                "fp32": "PyTorch strict fp32, eager (side note)"}  # fmt: skip
ORTFLOW_LABELS = {"fp32": "ortflow fp32 (defaults)", "fp16": "ortflow fp16 (defaults)",
                  "bf16": "ortflow bf16 (defaults)", "fp16-zero1": "ortflow fp16, ZeRO-1"}  # fmt: skip
ENV_SHOWN = ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES", "ORTFLOW_CUDA_LIB_DIRS", "OMP_NUM_THREADS")


def _label(record: dict) -> str | None:
    if record.get("kind") == "ortflow":
        return ORTFLOW_LABELS.get(record["precision"], f"ortflow {record['precision']}")
    if record.get("kind") == "torch":
        return TORCH_LABELS.get(record["mode"], f"PyTorch {record['mode']}")
    return None


def timings(rows: list) -> dict[tuple[str, int], list[dict]]:
    """(contender, world) -> the successful timed records, in round order."""
    found: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        for record in row.results:
            label = _label(record)
            if label and record.get("status", "ok") == "ok" and record.get("step_time_s"):
                found.setdefault((label, record["world"]), []).append({"round": row.round, **record})
    return found


def _median_ms(records: list[dict], key: str = "step_time_s") -> float | None:
    values = [r[key] * 1e3 for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def _cell(records: list[dict]) -> str:
    if not records:
        return "-"
    values = [r["step_time_s"] * 1e3 for r in records]
    med = statistics.median(values)
    per_round = " / ".join(f"{v:.1f}" for v in values)
    return f"{med:.1f} ({per_round})" if len(values) > 1 else f"{med:.1f}"


def summarize(rows: list) -> dict:
    """Medians, spreads, weak scaling, the headline ratios, ZeRO figures and fixture losses."""
    times = timings(rows)
    labels = list(dict.fromkeys(k[0] for k in times))
    worlds = sorted({k[1] for k in times})
    median = {f"{label} x{world}": _median_ms(times[(label, world)]) for label, world in times}
    table = []
    for label in labels:
        cells = {w: times.get((label, w), []) for w in worlds}
        one = _median_ms(cells.get(1, []))
        scaling = {w: round(one / m, 3) for w in worlds if w > 1 and one and (m := _median_ms(cells[w]))}
        table.append({"contender": label, "ms": {w: _cell(cells[w]) for w in worlds}, "weak_scaling": scaling})
    ratios = {}
    for world in worlds:
        compile_ms = median.get(f"{TORCH_LABELS['compile']} x{world}")
        for prec in ("fp16", "bf16", "fp32"):
            mine = median.get(f"{ORTFLOW_LABELS[prec]} x{world}")
            if mine and compile_ms:
                ratios[f"x{world} ortflow {prec} speed vs torch.compile"] = round(compile_ms / mine, 3)
        fp16, bf16 = median.get(f"{ORTFLOW_LABELS['fp16']} x{world}"), median.get(f"{ORTFLOW_LABELS['bf16']} x{world}")
        if fp16 and bf16:
            ratios[f"x{world} ortflow bf16 speed vs fp16"] = round(fp16 / bf16, 3)
    zero = {}
    for label, world in times:  # each ZeRO-1 row beside its ZeRO-0 twin (the same precision, the same GPUs)
        records = times[(label, world)]
        precision = records[0].get("precision", "") if records[0].get("kind") == "ortflow" else ""
        if not precision.endswith("-zero1"):
            continue
        base = precision.removesuffix("-zero1")
        for name, group in ((base, times.get((ORTFLOW_LABELS.get(base, f"ortflow {base}"), world), [])),
                            (precision, records)):
            if group:
                zero[f"{name} x{world}"] = {"zero_stage": group[-1].get("zero_stage"),
                                            "optimizer_mib_per_gpu": group[-1].get("optimizer_state_mib_per_gpu"),
                                            "update_ms": _median_ms(group, "update_time_s"),
                                            "step_ms": _median_ms(group)}
    buckets = [r for row in rows for r in row.results if r.get("kind") == "torch-buckets"]
    fixtures = [r for row in rows for r in row.results if r.get("kind") == "fixture"]
    for row in rows:  # a fixture run that died before printing its result still gets its line
        if row.phase == "fixtures" and not row.results:
            model, prec = row.name.split("-")[1:3]
            fixtures.append({"model": model, "precision": prec, "status": row.status, "final_loss": None})
    return {"table": table, "median_ms": median, "ratios": ratios, "zero": zero, "bucket_tuning": buckets,
            "fixtures": fixtures}  # fmt: skip


def _markdown(summary: dict, rows: list, meta: dict) -> str:
    worlds = sorted({w for entry in summary["table"] for w in entry["ms"]})
    out = [f"# GPU suite, {meta['date']}", "", f"- command: `{meta['command']}`", f"- commit: {meta['commit']}",
           f"- GPUs: {meta['gpus']}", f"- ortflow Python: {meta['ortflow_python']}",
           f"- PyTorch Python: {meta['torch_python']}", f"- mpiexec: {meta['mpiexec']}; CPUs: {meta['cpus']}",
           f"- environment: {meta['env']}", f"- wall time {meta['seconds']:.0f} s of a {meta['budget_s']:.0f} s budget",
           "", "ms per update: median over rounds (each round's figure in brackets); each figure is the median of the "
           "timed steps of the slowest rank.", ""]  # fmt: skip
    out += ["| contender | " + " | ".join(f"{w} GPU{'s' if w > 1 else ''}" for w in worlds) + " | weak scaling |",
            "|---|" + "---|" * len(worlds) + "---|"]
    for entry in summary["table"]:
        scaling = ", ".join(f"x{w}: {v}" for w, v in entry["weak_scaling"].items()) or "-"
        out.append(f"| {entry['contender']} | " + " | ".join(entry["ms"][w] for w in worlds) + f" | {scaling} |")
    out += ["", "Ratios (speed, higher is faster):", ""] + [f"- {k}: {v}" for k, v in summary["ratios"].items()]
    if summary["zero"]:
        out += ["", "| ZeRO | optimizer MiB per GPU | update ms | step ms |", "|---|---|---|---|"]
        for name, z in summary["zero"].items():
            out.append(f"| {name} | {z['optimizer_mib_per_gpu']} | {z['update_ms'] or float('nan'):.2f} | "
                       f"{z['step_ms'] or float('nan'):.1f} |")  # fmt: skip
    for tuned in summary["bucket_tuning"]:
        out.append(f"\nDDP bucket_cap_mb at {tuned['world']} GPUs (eager ms): {tuned['ms_by_bucket_mb']}, "
                   f"chosen {tuned['best_mb']}")  # fmt: skip
    if summary["fixtures"]:
        out += ["", f"Real exports, {60} updates through the CLI on one GPU (final logged loss):", "",
                "| model | precision | status | first logged loss | final loss | s |", "|---|---|---|---|---|---|"]
        for f in summary["fixtures"]:
            out.append(f"| {f['model']} | {f['precision']} | {f.get('status')} | {f.get('first_logged_loss')} | "
                       f"{f.get('final_loss')} | {f.get('seconds', '-')} |")  # fmt: skip
    out += ["", "| row | status | s | note |", "|---|---|---|---|"]
    for row in rows:
        note = row.error_tail.strip().splitlines()[0][:120] if row.error_tail.strip() else ""
        out.append(f"| {row.name} | {row.status} | {row.seconds:.0f} | {note} |")
    failed = [r for r in rows if r.status in ("failed", "timeout")]
    for row in failed:
        out += ["", f"### {row.name} ({row.status})", "", "```", row.error_tail[-1500:], "```"]
    return "\n".join(out) + "\n"


def write_report(out: Path, rows: list, info: dict, args, seconds: float) -> None:
    """``gpu-suite.json`` and ``gpu-suite.md`` in ``out``."""
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": shlex.join(sys.argv),
            "env": {k: os.environ[k] for k in ENV_SHOWN if k in os.environ}, "seconds": seconds,
            "budget_s": args.budget_s, "dry_run": args.dry_run, "args": vars(args),
            **{k: info.get(k, "-") for k in ("commit", "gpus", "topology", "ortflow_python", "torch_python",
                                              "mpiexec", "cpus")}}  # fmt: skip
    summary = summarize(rows)
    (out / "gpu-suite.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                    "rows": [r.as_dict() for r in rows]}, indent=1, default=str))
    (out / "gpu-suite.md").write_text(_markdown(summary, rows, meta))
