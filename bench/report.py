"""Markdown reports: the suite's (and PNG plots, when matplotlib is installed) from a results JSON written by
``python -m bench``, and the GPU suite's (``bench/gpu_suite.py``) from its rows.

``python -m bench.report RESULTS.json`` re-renders a report, e.g. for results copied from another machine.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.common import host, provenance, with_provenance

GOALS = {"overhead": 0.03, "efficiency_2": 0.95, "efficiency_16": 0.90, "ortflow_over_torch": 1.0}


def _f(value, fmt: str = "{:.3f}") -> str:
    return fmt.format(value) if isinstance(value, int | float) else "-"


def _mmm(s: dict | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    if not s or s.get("median") is None:
        return "-"
    return " / ".join(fmt.format(s[k] * scale) for k in ("min", "median", "max"))


def _layout(label: str) -> tuple[int, int]:
    n, t = label.split()[1].split("x")
    return int(n), int(t)


def plot(record: dict, out: Path) -> list[str]:
    """Throughput per layout (ortflow vs PyTorch) and weak-scaling efficiency; returns the PNG names written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib, or one built for another numpy (device machine): no plots
        return []
    names = []
    summary = record["summary"]
    layouts = sorted({label.split()[1] for label in summary}, key=lambda x: tuple(map(int, x.split("x"))))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    for i, kind in enumerate(("ortflow", "torch", "bare")):
        xs, meds, lo, hi = [], [], [], []
        for j, layout in enumerate(layouts):
            s = summary.get(f"{kind} {layout}", {}).get("tokens_per_s")
            if s and s["median"]:
                xs.append(j + (i - 1) * width)
                meds.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
        if xs:
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, label={"torch": "PyTorch DDP (gloo)",
                   "ortflow": "ortflow trainer", "bare": "bare engine loop"}[kind])  # fmt: skip
    ax.set_xticks(range(len(layouts)), [f"{x} (ranks x threads)" if k == 0 else x for k, x in enumerate(layouts)])
    ax.set_ylabel("tokens/s (median, min-max)")
    ax.set_title(f"Throughput, {record['host']['host']} ({record['host']['cores']} cores)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = out.stem + "-throughput.png"
    fig.savefig(out.parent / name, dpi=110)
    plt.close(fig)
    names.append(name)

    eff = record["ratios"]["weak_scaling_efficiency"]
    if any(eff[k] for k in eff):
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for kind, series in eff.items():
            pts = sorted((int(n), s["median"]) for n, s in series.items() if s.get("median") is not None)
            if pts:
                ax.plot([1] + [p[0] for p in pts], [1.0] + [p[1] for p in pts], marker="o",
                        label="ortflow" if kind == "ortflow" else "PyTorch DDP")  # fmt: skip
        ax.axhline(0.95, ls="--", lw=0.8, color="gray")
        ax.axhline(0.90, ls=":", lw=0.8, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (1 thread each, fixed batch per rank)")
        ax.set_ylabel("weak-scaling efficiency")
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = out.stem + "-scaling.png"
        fig.savefig(out.parent / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def render(record: dict, plots: list[str]) -> str:
    """The report's markdown."""
    h, m, r = record["host"], record["model"], record["ratios"]
    lines = [f"# ortflow benchmark: {h['host']}, {h['date']}", "", *provenance(record["command"], h), ""]
    s = record["setup"]
    lines += [f"Model: the PyTorch GPT of `bench/torch_gpt.py` exported to ONNX, {m['shape']}, "
              f"{m['num_params'] / 1e6:.2f} M parameters, {m['train_flops_per_token'] / 1e6:.1f} MFLOP per token "
              f"(training: 6 x matmul parameters + attention). Batch {s['batch_size']} x {m['shape']['seq_len']} "
              f"tokens per rank (weak scaling); AdamW. Each contender: {s['warmup_steps']} warm-up steps, then "
              f"{s['timed_steps']} timed; {max((len(v) for v in record['runs'].values()), default=0)} interleaved "
              f"rounds; figures are min / median / max over rounds; ratios are taken within a round.", ""]  # fmt: skip

    ov = r["trainer_overhead"]
    eff = r["weak_scaling_efficiency"]
    lines += ["## Goals", "", "| goal | measured (median; min..max) | met |", "|---|---|---|"]
    if ov.get("median") is not None:
        lines.append(f"| trainer overhead vs bare engine loop <= 3% (1x1) | {ov['median']:+.1%} "
                     f"({ov['min']:+.1%}..{ov['max']:+.1%}) | {'yes' if ov['median'] <= GOALS['overhead'] else 'no'} |")
    for n, e in eff.get("ortflow", {}).items():
        goal = GOALS["efficiency_2"] if int(n) <= 2 else GOALS["efficiency_16"] if int(n) >= 16 else None
        if e.get("median") is not None:
            met = "-" if goal is None else ("yes" if e["median"] >= goal else "no")
            lines.append(f"| weak-scaling efficiency, {n} ranks{f' >= {goal}' if goal else ''} | {e['median']:.3f} "
                         f"({e['min']:.3f}..{e['max']:.3f}) | {met} |")
    for layout, q in r["ortflow_over_torch"].items():
        if q.get("median") is not None:
            lines.append(f"| ortflow / PyTorch DDP eager throughput >= 1, {layout} | {q['median']:.3f} "
                         f"({q['min']:.3f}..{q['max']:.3f}) | {'yes' if q['median'] >= 1 else 'no'} |")
    for layout, q in r.get("ortflow_over_torch_best_mode", {}).items():
        if q.get("median") is not None:
            lines.append(f"| ortflow / PyTorch's fastest mode in the round >= 1, {layout} | {q['median']:.3f} "
                         f"({q['min']:.3f}..{q['max']:.3f}) | {'yes' if q['median'] >= 1 else 'no'} |")
    q = r.get("ortflow_best_over_torch_best_all_cores", {})
    if q.get("median") is not None:
        lines.append(f"| ortflow's best all-core layout / PyTorch's best all-core layout and mode >= 1 | "
                     f"{q['median']:.3f} ({q['min']:.3f}..{q['max']:.3f}) | {'yes' if q['median'] >= 1 else 'no'} |")
    lines.append("")
    if record.get("torch_best_row"):
        lines += [f"PyTorch's fastest row (median samples/s): `{record['torch_best_row']}`. The best-of ratios take, "
                  "in each round, the fastest contender of each side (eager, `torch.compile` with inductor's C++ "
                  "backend, bf16 autocast where the CPU has bf16 instructions); per round the winners were "
                  + "; ".join(f"{lay}: " + ", ".join(f"{a} vs {b}" for a, b in v.get("best", []))
                              for lay, v in r.get("ortflow_over_torch_best_mode", {}).items() if v.get("best"))
                  + ".", ""]  # fmt: skip

    lines += ["## Throughput", "", "| contender (ranks x threads) | step time ms | samples/s | tokens/s | "
              "GFLOP/s | fraction of GEMM ceiling |", "|---|---|---|---|---|---|"]  # fmt: skip
    for label in sorted(record["summary"], key=lambda x: (_layout(x), x)):
        sm = record["summary"][label]
        fc = record["fraction_of_ceiling"].get(label, {})
        lines.append(f"| {label} | {_mmm(sm['step_time_s'], 1e3, '{:.1f}')} | {_mmm(sm['samples_per_s'], 1, '{:.2f}')} "
                     f"| {_mmm(sm['tokens_per_s'], 1, '{:.0f}')} | {_f(fc.get('gflops'), '{:.1f}')} | "
                     f"{_f(fc.get('fraction'), '{:.1%}')} |")
    lines.append("")
    lines += [f"![{p}]({p})" for p in plots] + [""]
    if r.get("intra_op_speedup"):
        speedups = [f"{k} {v['median']:.2f}" for k, v in r["intra_op_speedup"].items() if v.get("median")]
        lines += ["Speed-up of 1 rank x all threads over 1 x 1: " + ", ".join(speedups) + ".", ""]

    c = record["ceiling"]
    lines += ["## Ceiling", "", f"float32 GEMM (numpy matmul): {_f(c['gemm_gflops_1_thread'], '{:.1f}')} GFLOP/s with "
              f"1 thread, {_f(c['gemm_gflops_all_threads'], '{:.1f}')} GFLOP/s with {c['cores']} threads. The fraction "
              "above is achieved GFLOP/s / (1-thread GEMM GFLOP/s x cores used).", ""]  # fmt: skip
    sanity = record.get("sanity")
    if sanity:
        lines += ["## Same model", "", "First losses from the same initial weights on the same batches, same AdamW: "
                  f"engine {[round(x, 5) for x in sanity['engine_losses']]}, PyTorch "
                  f"{[round(x, 5) for x in sanity['torch_losses']]}; relative difference at step 1 "
                  f"{sanity['first_step_rel_diff']:.1e}, at most {sanity['max_rel_diff']:.1e}.", ""]  # fmt: skip
    ar = record.get("allreduce")
    if ar:
        lines += ["## All-reduce", "", f"{ar['world']} ranks, {ar['bytes'] / 1e6:.1f} MB in {ar['num_tensors']} "
                  f"gradients: ortflow `MPIComm.average_gradients` (pack, one Allreduce, unpack with the 1/N scale) "
                  f"{_mmm(ar['ortflow'], 1e3, '{:.2f}')} ms vs a bare mpi4py Allreduce of the same bytes "
                  f"{_mmm(ar['bare_mpi'], 1e3, '{:.2f}')} ms (min / median / max); ratio of medians "
                  f"{ar['ratio_median']:.2f}.", ""]  # fmt: skip
    ck = record.get("checkpoint")
    if ck:
        lines += ["## Checkpoints", "", f"The trainer's save of a complete checkpoint ({ck['bytes'] / 1e6:.1f} MB: "
                  f"parameters + AdamW moments, fsync, checksum, meta.json, rename): {_mmm(ck['save'], 1e3, '{:.0f}')} "
                  f"ms. Every {ck['period_steps']} steps of {_f(ck['step_time_s'], '{:.3f}')} s (ortflow 1x1) that is "
                  f"{_f(ck.get('fraction_of_training'), '{:.2%}')} of training time.", ""]  # fmt: skip
    dp = record.get("dataprep")
    if dp:
        w = dp["write"]
        lines += ["## Data preparation", "", f"`prepare_data` {w['prepare_data_mb_per_s']} MB/s vs pyarrow's own IPC "
                  f"write {w['pyarrow_ipc_write_mb_per_s']} MB/s (ratio {w['ratio_prepare_over_pyarrow']}; "
                  f"{w['note']}). "
                  "Full results: `bench/reports/dataprep.json` (from `bench/bench_dataprep.py`).", ""]  # fmt: skip
    if "load_average_at_end" in record:
        lines += [f"Load average (1, 5, 15 min) at start {h.get('load_average_at_start')}, at end "
                  f"{record['load_average_at_end']}: load above 0 comes from other processes on the cores.",
                  ""]  # fmt: skip
    lines += [f"Suite wall time: {record.get('wall_s', 0):.0f} s. Per-run logs: `{Path(record.get('logs', '')).name}`."]
    return "\n".join(lines) + "\n"


def write_report(json_path: Path) -> Path:
    """Render ``json_path``'s report beside it (``.md`` and PNGs); returns the markdown path."""
    json_path = Path(json_path)
    record = json.loads(json_path.read_text())
    md = json_path.with_suffix(".md")
    md.write_text(render(record, plot(record, md)))
    return md


# The GPU suite's report: ``gpu-suite.json`` (everything) and ``gpu-suite.md`` (the tables), from its rows.

TORCH_LABELS = {"eager": "PyTorch bf16 autocast, eager", "compile": "PyTorch bf16 autocast + torch.compile",
                "cudagraphs": "PyTorch bf16 autocast + torch.compile, CUDA graphs",
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


def gpu_suite_timings(rows: list) -> dict[tuple[str, int], list[dict]]:
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


def gpu_suite_summary(rows: list) -> dict:
    """Medians, spreads, weak scaling, the headline ratios, ZeRO figures and fixture losses."""
    times = gpu_suite_timings(rows)
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
        torch_ms = [(ms, mode) for mode, label in TORCH_LABELS.items()
                    if mode != "fp32" and (ms := median.get(f"{label} x{world}"))]  # the strict-fp32 side note aside
        fastest = min(torch_ms, default=None)
        for prec in ("fp16", "bf16", "fp32"):
            mine = median.get(f"{ORTFLOW_LABELS[prec]} x{world}")
            if mine and compile_ms:
                ratios[f"x{world} ortflow {prec} speed vs torch.compile"] = round(compile_ms / mine, 3)
            if mine and fastest:
                ratios[f"x{world} ortflow {prec} speed vs PyTorch's fastest mode ({fastest[1]})"] = round(
                    fastest[0] / mine, 3)
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


def _gpu_suite_markdown(summary: dict, rows: list, meta: dict) -> str:
    worlds = sorted({w for entry in summary["table"] for w in entry["ms"]})
    out = [f"# GPU suite, {meta['date']}", "", f"- ortflow Python: {meta['ortflow_python']}",
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
    return with_provenance("\n".join(out), meta["command"], {**meta.get("host", {}), "commit": meta["commit"],
                                                           "gpu": meta["gpus"]})


def write_gpu_suite_report(out: Path, rows: list, info: dict, args, seconds: float) -> None:
    """``gpu-suite.json`` and ``gpu-suite.md`` in ``out``."""
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": shlex.join(sys.argv), "host": host(),
            "env": {k: os.environ[k] for k in ENV_SHOWN if k in os.environ}, "seconds": seconds,
            "budget_s": args.budget_s, "dry_run": args.dry_run, "args": vars(args),
            **{k: info.get(k, "-") for k in ("commit", "gpus", "topology", "ortflow_python", "torch_python",
                                              "mpiexec", "cpus")}}  # fmt: skip
    summary = gpu_suite_summary(rows)
    (out / "gpu-suite.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                    "rows": [r.as_dict() for r in rows]}, indent=1, default=str))
    (out / "gpu-suite.md").write_text(_gpu_suite_markdown(summary, rows, meta))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(write_report(Path(arg)))
