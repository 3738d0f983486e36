"""ortflow's AdamW ``rule: torch`` against the real ``torch.optim.AdamW`` on the same gradients (needs the bench extra).

    python -m bench optim-torch-check [--steps 100]

Both start from the same float32 parameters and see the same gradients for ``--steps`` updates (a varying learning
rate, weight decay on all but the bias-like tensors); prints the largest absolute difference relative to the
parameters' scale and exits 1 if it exceeds fp32 rounding accumulated over the steps (2e-5, the bound the float64
reference test uses).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ortflow.config import OptimizerConfig
from ortflow.trainer.optim import build_update, whole_segments


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    sizes, names = (700, 33, 20000), ("w1", "b1", "w2")
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    ours = [p.copy() for p in init]
    opt = OptimizerConfig(beta1=0.9, beta2=0.99, epsilon=1e-6, weight_decay=0.1, no_weight_decay=("b*",))
    update = build_update(opt, whole_segments(names, sizes), ours)
    theirs = [torch.tensor(p, requires_grad=True) for p in init]
    groups = [{"params": [theirs[0], theirs[2]], "weight_decay": 0.1}, {"params": [theirs[1]], "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, foreach=False)
    for k in range(args.steps):
        lr = 1e-2 * (0.5 + 0.5 * np.cos(k / args.steps))
        grads = [rng.standard_normal(s).astype(np.float32) for s in sizes]
        for t, g in zip(theirs, grads, strict=True):
            t.grad = torch.from_numpy(g.copy())
        for group in adamw.param_groups:
            group["lr"] = lr
        adamw.step()
        update.step([g.copy() for g in grads], lr)
    worst = max(float(np.abs(o - t.detach().numpy()).max()) / max(1.0, float(np.abs(o).max()))
                for o, t in zip(ours, theirs, strict=True))
    print(f"ortflow adamw (rule torch) vs torch.optim.AdamW {torch.__version__}, {args.steps} steps: "
          f"max |difference| / scale = {worst:.2e}")
    return 0 if worst <= 2e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
