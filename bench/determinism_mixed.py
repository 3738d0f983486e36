"""Is a precision's training run-to-run deterministic on the GPU? ``python bench/determinism_mixed.py ROOT [DEVICE]``

For each variant (fp32, fp16, fp16 with Gather in fp32, bf16) a small GPT is configured once and trained twice, each
time in a fresh session from the same initial checkpoint on the same batches (60 updates, the loop's update: loss
scale, average, norm, skip, AdamW), with the engine's deterministic kernels off and on (distributed.
deterministic_compute). Prints one ``RESULT`` line per run pair: the parameters' sha256 of both runs, the first update
whose loss differs, the largest parameter difference and the seconds per run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

SHAPE = {"vocab_size": 256, "seq_len": 16, "d_model": 64, "num_layers": 2, "num_heads": 2}
VARIANTS = {
    "fp32": {},
    "fp16": {"use_mixed_precision": True},
    "fp16-gather32": {"use_mixed_precision": True, "fp32_ops": ["LayerNormalization", "Softmax", "Gather"]},
    "bf16": {"use_mixed_precision": True, "use_bfloat16": True},
}
UPDATES = 60


def train_once(run_dir: Path, batches: list[dict]) -> tuple[list[float], dict[str, np.ndarray]]:
    from ortflow.config import load_run_config
    from ortflow.trainer.comm import SingleProcessComm
    from ortflow.trainer.runtime import init_runtime

    cfg = load_run_config(run_dir)
    rt = init_runtime(run_dir, cfg, SingleProcessComm())
    scaler, names, grads, losses = rt.loss_scale, rt.module.input_names(), [], []
    scalars = np.zeros(2, dtype=np.float32)
    for k in range(UPDATES):
        feeds = scaler.feed(batches[k % len(batches)])
        loss = float(rt.module(*(feeds[n] for n in names)))
        grads = grads or rt.gradient_buffers()
        scalars[0] = loss / scaler.scale
        mine = rt.exchange.reduce(grads, scaler.scale, scalars)  # as the loop: ortflow's exchange and update
        if scaler.update(rt.exchange.norm(mine)):
            rt.update.step(mine, cfg.optimizer.learning_rate)
        rt.exchange.gather()
        rt.module.lazy_reset_grad()
        losses.append(loss / scaler.scale)
    params = {n: np.array(rt.state.parameters[n].data) for n in rt.trainable}
    rt.comm.close()
    return losses, params


def main(root: Path, device: str) -> None:
    from ortflow.build.configure import configure
    from ortflow.config import config_from_dict
    from ortflow.examples.gpt import build_gpt

    root.mkdir(parents=True, exist_ok=True)
    model = build_gpt(root / "gpt.onnx", **SHAPE)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        tokens = rng.integers(0, SHAPE["vocab_size"], (16, SHAPE["seq_len"] + 1), dtype=np.int64)
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].reshape(-1)})
    for (name, precision), deterministic in itertools.product(VARIANTS.items(), (False, True)):
        if device == "cpu" and precision:
            continue
        cfg = config_from_dict({
            "output_dir": str(root / f"{name}-{deterministic}"), "model": {"path": str(model), "loss": "cross_entropy"},
            "data": {"train": [str(root / "unused.npz")]}, "train": {"batch_size": 16, "num_train_steps": UPDATES},
            "optimizer": {"learning_rate": 3e-3},
            "distributed": {"device": device, "use_nccl": device != "cpu", "deterministic_compute": deterministic},
            "precision": precision,
        })  # fmt: skip
        configure(cfg)
        start = time.perf_counter()
        (l1, p1), (l2, p2) = train_once(cfg.output_dir, batches), train_once(cfg.output_dir, batches)
        seconds = (time.perf_counter() - start) / 2
        digest = [hashlib.sha256(b"".join(p[n].tobytes() for n in sorted(p))).hexdigest()[:16] for p in (p1, p2)]
        first = next((i + 1 for i, (a, b) in enumerate(zip(l1, l2, strict=True)) if a != b), None)
        worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
        print("RESULT " + json.dumps({"variant": name, "deterministic_compute": deterministic,
                                      "seconds_per_run": round(seconds, 2), "identical": digest[0] == digest[1],
                                      "sha256": digest,
                                      "first_differing_update": first, "max_param_diff": worst,
                                      "final_loss": l1[-1]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cuda")
