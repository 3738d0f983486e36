"""Contenders on the same model and batch, interleaved round by round (A, B, C, A, B, C, ... with the order reversed
every other round so that a slow drift of the machine hits every contender alike).

* ``ortflow``: the real trainer, ``mpiexec -n N python -m ortflow.trainer RUN_DIR``; its step time is read from the
  rank-0 progress lines (``samples_per_s`` of each display window), skipping the warm-up windows and the final one
  (which also holds the end-of-run evaluation).
* ``bare``: the bare engine loop (``bench.workers bare``), 1 rank only: the trainer-overhead reference.
* ``torch``: PyTorch eager + DDP (gloo) on the same architecture and initial weights (``bench.workers torch``);
  ``torch-compile`` (``torch.compile``, inductor's C++ backend), ``torch-bf16`` (bf16 autocast) and
  ``torch-compile-bf16`` are the same with that mode.

Every contender reports its steady-state mean step time; throughput is world x batch / step time.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import Setup, parse_result, random_tokens, run_command, spawn_ranks, summarize, thread_env
from ortflow.config import RunConfig, config_from_dict
from ortflow.trainer.metrics import PROGRESS_FILE

# The workload: the PyTorch GPT exported to ONNX, token data, and one configured + sharded run folder. The run folder
# is configured once; set_layout re-configures it for another ranks x threads layout (the engine's artifacts are
# reused: the distributed section is outside configure's fingerprint) and clears checkpoints, so that every trainer
# run starts from the initial weights.

LEARNING_RATE = 1e-3
SEED = 0


def export_model(root: Path, shape: dict, seed: int = SEED) -> Path:
    """``root/gpt.onnx``: the PyTorch GPT of ``shape`` with its seed-``seed`` initial weights."""
    from bench.torch_gpt import GPT, GPTShape, export_onnx

    path = root / "gpt.onnx"
    if not path.exists():
        export_onnx(GPT(GPTShape(**shape), seed=seed), path)
    return path


def write_tokens(root: Path, shape: dict, rows: int, seed: int = SEED) -> Path:
    """``root/tokens.npz`` with ``input_ids`` and next-token ``labels`` windows [rows, seq_len]."""
    path = root / "tokens.npz"
    if not path.exists():
        tokens = random_tokens(rows, shape["seq_len"], shape["vocab_size"], seed)
        np.savez(path, input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    return path


def run_config(root: Path, setup: Setup, num_ranks: int, threads: int) -> RunConfig:
    """The trainer's config for one layout; timing windows are the progress line's display windows."""
    raw = {
        "name": "bench-gpt",
        "output_dir": str(root / "run"),
        "model": {"path": str(root / "gpt.onnx"), "loss": "cross_entropy", "label_input": "labels"},
        "data": {"train": [str(root / "tokens.npz")], "eval_fraction": 0.0, "rows_per_shard": 4096},
        "train": {
            # one window more than the others run: the final window also holds the end-of-run evaluation, so it is
            # not timed (bench.compare.trainer_step_time)
            "batch_size": setup.batch_size, "num_train_steps": setup.total_steps + setup.display_steps,
            "display_loss_steps": setup.display_steps, "evaluation_period": 0, "seed": SEED,
        },
        "optimizer": {"name": "adamw", "learning_rate": LEARNING_RATE},
        "lr_schedule": {"name": "constant"},
        "distributed": {"num_ranks": num_ranks, "threads_per_rank": threads},
        "checkpoint": {"period": 0, "max_num_checkpoints": 1},
    }  # fmt: skip
    return config_from_dict(raw)


def build(root: Path, setup: Setup, rows: int) -> RunConfig:
    """Export the model, write the tokens, configure and shard the run folder (1 x 1 layout)."""
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    root.mkdir(parents=True, exist_ok=True)
    export_model(root, setup.shape)
    write_tokens(root, setup.shape, rows)
    cfg = run_config(root, setup, 1, 1)
    configure(cfg)
    prepare_data(cfg)
    return cfg


def set_layout(root: Path, setup: Setup, num_ranks: int, threads: int) -> RunConfig:
    """Re-configure the run folder for ``num_ranks`` x ``threads`` and remove what a previous run left."""
    from ortflow.configure.configure import configure

    cfg = run_config(root, setup, num_ranks, threads)
    result = configure(cfg)
    if not result.reused:
        raise RuntimeError("configure rebuilt the artifacts for a layout change; the bench expects reuse")
    shutil.rmtree(cfg.checkpoints_dir, ignore_errors=True)
    shutil.rmtree(cfg.tensorboard_dir, ignore_errors=True)
    (cfg.output_dir / PROGRESS_FILE).unlink(missing_ok=True)
    return cfg


_PROGRESS = re.compile(r"step (\d+)/(\d+) \|.*?samples_per_s ([0-9.eE+-]+)")


@dataclass(frozen=True)
class Contender:
    """One way of training: who, and with how many ranks x threads."""

    kind: str  # ortflow | bare | torch | torch-compile | torch-bf16 | torch-compile-bf16
    ranks: int
    threads: int

    @property
    def label(self) -> str:
        return f"{self.kind} {self.ranks}x{self.threads}"


def trainer_step_time(output: str, setup: Setup, world: int) -> float | None:
    """Steady-state seconds per weight update from the trainer's progress lines (None if none qualified)."""
    seconds = steps = 0.0
    for match in _PROGRESS.finditer(output):
        step, total, samples_per_s = int(match[1]), int(match[2]), float(match[3])
        if step - setup.display_steps < setup.warmup_steps or step >= total:
            continue
        seconds += setup.display_steps * world * setup.batch_size / samples_per_s
        steps += setup.display_steps
    return seconds / steps if steps else None


def run_one(c: Contender, root: Path, setup: Setup, logs: Path, timeout: float = 900) -> dict:
    """Run a contender once; returns its record (step_time_s None when it failed: see its log)."""
    env = {**setup.env, **thread_env(c.threads)}
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{c.kind}-{c.ranks}x{c.threads}.log"
    shape = json.dumps(setup.shape)
    if c.kind == "ortflow":
        cfg = set_layout(root, setup, c.ranks, c.threads)
        cmd = [*setup.mpiexec, "-n", str(c.ranks), setup.python, "-u", "-m", "ortflow.trainer", str(cfg.output_dir)]
        code, out, wall = run_command(cmd, env, timeout, log)
        step_time = trainer_step_time(out, setup, c.ranks) if code == 0 else None
    elif c.kind == "bare":
        cmd = [setup.python, "-m", "bench.workers", "bare", str(root / "run"), "--threads", str(c.threads),
               "--warmup", str(setup.warmup_steps), "--steps", str(setup.timed_steps)]  # fmt: skip
        set_layout(root, setup, 1, c.threads)
        code, out, wall = run_command(cmd, env, timeout, log)
        result = parse_result(out) if code == 0 else None
        step_time = result["step_time_s"] if result else None
    elif c.kind == "torch" or c.kind.startswith("torch-"):
        mode = c.kind.partition("-")[2] or "eager"
        cmd = [setup.python, "-m", "bench.workers", "torch", "--shape", shape, "--batch-size",
               str(setup.batch_size), "--threads", str(c.threads), "--warmup", str(setup.warmup_steps),
               "--steps", str(setup.timed_steps), "--mode", mode]  # fmt: skip
        code, out = spawn_ranks(cmd, c.ranks, env, timeout)
        log.write_text(f"$ {' '.join(cmd)} (x{c.ranks} ranks)\n{out}\nexit {code}\n")
        result = parse_result(out) if code == 0 else None
        step_time = result["step_time_s"] if result else None
    else:
        raise ValueError(f"unknown contender kind {c.kind!r}: use ortflow, bare, torch or torch-<mode>")
    samples_per_s = c.ranks * setup.batch_size / step_time if step_time else None
    tokens_per_s = samples_per_s * setup.shape["seq_len"] if samples_per_s else None
    return {"step_time_s": step_time, "samples_per_s": samples_per_s, "tokens_per_s": tokens_per_s, "exit": code}


def interleaved(contenders: list[Contender], rounds: int, root: Path, setup: Setup, logs: Path,
                progress=print) -> dict[str, list[dict]]:  # fmt: skip
    """Run every contender once per round, alternating the order; returns each contender's runs, by label."""
    runs: dict[str, list[dict]] = {c.label: [] for c in contenders}
    for r in range(rounds):
        order = contenders if r % 2 == 0 else list(reversed(contenders))
        for c in order:
            record = run_one(c, root, setup, logs / f"round{r}")
            record["round"] = r
            runs[c.label].append(record)
            step = record["step_time_s"]
            shown = f"{step * 1e3:.1f} ms/step" if step else f"FAILED (exit {record['exit']})"
            progress(f"  round {r + 1}/{rounds} {c.label:>14}: {shown}")
    return runs


def paired_ratio(runs: dict[str, list[dict]], a: str, b: str, key: str = "samples_per_s") -> dict:
    """min/median/max over rounds of ``a[key] / b[key]`` taken within the same round."""
    by_round = {x["round"]: x[key] for x in runs.get(b, []) if x[key]}
    ratios = [x[key] / by_round[x["round"]] for x in runs.get(a, []) if x[key] and x["round"] in by_round]
    return summarize(ratios)


def paired_best_ratio(runs: dict[str, list[dict]], a: list[str], b: list[str], key: str = "samples_per_s") -> dict:
    """min/median/max over rounds of (best of ``a`` in the round) / (best of ``b`` in the round), with the labels that
    were best in each round; rounds where every contender of either side failed are skipped."""
    def best(labels: list[str]) -> dict[int, tuple[float, str]]:
        out: dict[int, tuple[float, str]] = {}
        for label in labels:
            for x in runs.get(label, []):
                if x[key] and (x["round"] not in out or x[key] > out[x["round"]][0]):
                    out[x["round"]] = (x[key], label)
        return out

    top_a, top_b = best(a), best(b)
    rounds = sorted(set(top_a) & set(top_b))
    result = summarize([top_a[r][0] / top_b[r][0] for r in rounds])
    result["best"] = [[top_a[r][1], top_b[r][1]] for r in rounds]
    return result


def best_label(summary: dict[str, dict], labels: list[str], key: str = "samples_per_s") -> str | None:
    """The label with the highest median ``key`` among ``labels`` (None when all failed)."""
    scored = [(summary[label][key]["median"], label) for label in labels
              if label in summary and summary[label][key]["median"]]  # fmt: skip
    return max(scored)[1] if scored else None


def summarize_runs(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per contender: min/median/max of step time, samples/s and tokens/s."""
    return {
        label: {key: summarize([x[key] for x in records]) for key in ("step_time_s", "samples_per_s", "tokens_per_s")}
        for label, records in runs.items()
    }


def median_of(summary: dict[str, dict], label: str, key: str = "samples_per_s") -> float | None:
    return summary.get(label, {}).get(key, {}).get("median")


def scaling_efficiency(runs: dict[str, list[dict]], kind: str, ranks: int) -> dict:
    """Weak-scaling efficiency throughput(N x 1) / (N x throughput(1 x 1)), paired within rounds."""
    ratio = paired_ratio(runs, f"{kind} {ranks}x1", f"{kind} 1x1")
    return {k: (v / ranks if isinstance(v, float) else v) for k, v in ratio.items()}


def overhead(runs: dict[str, list[dict]]) -> dict:
    """Trainer step time over the bare loop's, minus one (paired within rounds), at 1 rank x 1 thread."""
    ratio = paired_ratio(runs, "ortflow 1x1", "bare 1x1", key="step_time_s")
    return {k: (v - 1.0 if isinstance(v, float) else v) for k, v in ratio.items()}


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
