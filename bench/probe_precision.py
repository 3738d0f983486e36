"""Which ops the engine trains in fp16 and bf16 on CUDA (onnxruntime-training 1.19.2): run on a GPU.

``python bench/probe_precision.py ROOT`` tries, for fp32, fp16 and bf16, a small GPT (``ortflow.examples.gpt``)
rewritten by the autocast pass: build the artifacts, make the training session on ``cuda:0`` with verbose logging,
run three updates and one eval. When the engine names an op it has no kernel for ("Could not find an implementation
for X", or a type error naming the operator), that op (or, for ``XGrad``, its forward op X) is added to the fp32
list and the attempt is repeated. It also lists the op types placed on the CPU provider that the fp32 graph does not
place there: CUDA kernels missing for that type (ORT falls back to a CPU kernel silently when one exists).
Prints one ``RESULT {json}`` line per precision and a summary.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPE = {"vocab_size": 512, "seq_len": 64, "d_model": 128, "num_layers": 2, "num_heads": 4}
BATCH = 8
_MISSING = (re.compile(r"implementation for (\w+)\("), re.compile(r"of operator \((\w+)\)"))


def attempt(root: Path, precision: str, extra: list[str]) -> dict:
    """One try in this process: artifacts, session, 3 updates (plain SGD), 1 eval; returns what happened."""
    import onnxruntime

    from ortflow.build.artifacts import build_artifacts
    from ortflow.config import config_from_dict
    from ortflow.engine import api
    from ortflow.examples.gpt import build_gpt
    from ortflow.trainer.loss_scale import INPUT_NAME
    from ortflow.trainer.runtime import select_device

    model = root / "gpt.onnx"
    if not model.exists():
        build_gpt(model, **SHAPE)
    mixed = precision != "fp32"
    cfg = config_from_dict({
        "output_dir": str(root / f"{precision}-{len(extra)}"),
        "model": {"path": str(model), "loss": "cross_entropy"},
        "data": {"train": [str(root / "unused.npz")]},
        "train": {"batch_size": BATCH, "num_train_steps": 3},
        "distributed": {"device": "cuda", "use_nccl": True},
        "precision": {"use_mixed_precision": mixed, "use_bfloat16": precision == "bf16", "fp32_ops": extra},
    })  # fmt: skip
    build_artifacts(cfg, cfg.artifacts_dir)
    device = select_device(cfg, 0)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 0  # verbose: the node placements are logged
    art = cfg.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"), device=device,
                        session_options=options)
    # ortflow owns the update, so its artifacts hold no engine optimizer model: a plain SGD step on the parameters
    # through the checkpoint state moves the weights between the probe's updates (the probe tests the kernels).
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, SHAPE["vocab_size"], (BATCH, SHAPE["seq_len"] + 1), dtype=np.int64)
    feeds = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].reshape(-1), INPUT_NAME: np.array(1.0, np.float32)}
    losses, finite = [], True
    for _ in range(3):
        losses.append(float(module(*(feeds[n] for n in module.input_names()))))
        finite &= all(bool(np.isfinite(p.grad).all()) for _, p in state.parameters if p.requires_grad)
        for _, param in state.parameters:
            if param.requires_grad:
                param.data = param.data - np.float32(1e-3) * param.grad
        module.lazy_reset_grad()
    module.eval()
    eval_loss = float(module(*(feeds[n] for n in module.input_names())))
    return {"precision": precision, "fp32_ops_added": extra, "losses": losses, "eval_loss": eval_loss,
            "grads_finite": finite}


def _placements(log: str) -> tuple[set[str], str]:
    """Op types the verbose log lists under 'placed on [CPUExecutionProvider]', and those sections' text."""
    found, inside, kept = set(), False, []
    for line in log.splitlines():
        if "placed on [" in line:
            inside = "CPUExecutionProvider" in line
            kept.append(line)
            continue
        match = re.search(r"(?:\]|^)\s+(\w+) \(", line) if inside else None
        if match:
            found.add(match.group(1))
            kept.append(line)
        else:
            inside = False
    return found, "\n".join(kept)


def probe(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    cpu_fp32: set[str] = set()
    summary = {}
    for precision in ("fp32", "fp16", "bf16"):
        extra: list[str] = []
        result: dict = {}
        for _ in range(10):
            proc = subprocess.run([sys.executable, __file__, "attempt", str(root), precision, json.dumps(extra)],
                                  capture_output=True, text=True, timeout=300, check=False)
            text = proc.stderr + proc.stdout
            placed, sections = _placements(text)
            (root / f"placements-{precision}-{len(extra)}.txt").write_text(sections)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line:
                result = json.loads(line[7:])
                result["cpu_placed_beyond_fp32"] = sorted(placed - cpu_fp32)
                if precision == "fp32":
                    cpu_fp32 = placed
                    result["cpu_placed"] = sorted(placed)
                break
            names = [m.group(1) for pattern in _MISSING for m in pattern.finditer(text)]
            ops = [re.sub(r"Grad(_\d+)?$", "", n) for n in names]
            new = [op for op in dict.fromkeys(ops) if op not in extra]
            if not new:
                error = proc.stderr[proc.stderr.rfind("Traceback"):] or text
                result = {"precision": precision, "fp32_ops_added": extra, "error": error[-3000:]}
                break
            print(f"{precision}: the engine lacks {names[:3]}: keeping {new[0]} in fp32", flush=True)
            extra.append(new[0])
        print("RESULT " + json.dumps(result), flush=True)
        summary[precision] = result
    (root / "probe.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "attempt":
        print("RESULT " + json.dumps(attempt(Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))), flush=True)
    else:
        probe(Path(sys.argv[1]))
