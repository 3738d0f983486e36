"""Tensor parallelism for real: a 2-layer GPT split over 2 ranks (``mpiexec -n 2``) and 2 x 2 (``-n 4``)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import ortflow
from ortflow.trainer.checkpoints import list_complete
from ortflow.trainer.checkpoints.h5state import read_params

from .runs import make_run, run_ranks

pytestmark = pytest.mark.mpi

SEQ = 16
TRAIN = {"batch_size": 2, "num_train_steps": 8, "gradient_accumulation_steps": 2, "evaluation_period": 2,
         "display_loss_steps": 1, "max_eval_batches": 1}
# The split changes where fp32 sums are rounded: a row-split MatMul's hp partial products are added after the local
# dot products (the unsplit MatMul adds all terms in one), and a split region's input gradient is summed the same way;
# each such sum differs by a few ulps. With SGD that reaches the weights as is: measured max |diff| 3.7e-9 after 4
# updates (hp 2 x dp 2, lr 1e-2; about one ulp of a 0.02 weight), so SGD is held to 1e-7. AdamW's step
# m / (sqrt(v) + eps) normalizes each entry: an entry whose gradient is at rounding level (~1e-7) gets a step of
# up to ~lr whatever its sign, so a few-ulp change there moves that weight by up to ~lr per update. Measured max
# |diff| 4.0e-5 (h1.mlp.proj.weight) with lr 1e-3 vs a largest move of 4.0e-3; AdamW is held to 0.1 lr = 1e-4. A
# wrong split (a missing all-reduce, a bias added twice, a wrong slice) moves weights by ~lr and fails both.
ATOL = {"sgd": 1e-7, "adamw": 1e-4}
LR = {"sgd": 1e-2, "adamw": 1e-3}


def gpt_run(root: Path, name: str, **sections):
    """A run on a 2-layer GPT (d_model 32, 4 heads) over ortflow's own sources, byte-level."""
    from ortflow.examples.gpt import build_gpt

    model = root / "gpt2l.onnx"
    if not model.exists():
        build_gpt(model, seq_len=SEQ, d_model=32, num_layers=2, num_heads=4)
    corpus = root / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("\n".join(p.read_text() for p in sorted(Path(ortflow.__file__).parent.rglob("*.py"))[:6]))
    data = {"train": [str(corpus)], "format": "text", "text": {"seq_len": SEQ}, "eval_fraction": 0.05}
    train = {**TRAIN, **sections.pop("train", {})}
    optimizer = {"learning_rate": 1e-3, **sections.pop("optimizer", {})}
    return make_run(root, name, model=model, data=data, train=train, optimizer=optimizer, **sections)


def initial_parameters(cfg) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(cfg.model.path)).graph.initializer}


def losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"\] \S+ INFO step \d+/\d+ \| loss ([0-9.e+-]+)", output)]


def newest(cfg):
    return list_complete(cfg.checkpoints_dir)[-1].path


@pytest.mark.parametrize("hp,ranks,rule", [(2, 2, "adamw"), (2, 4, "sgd"), (2, 4, "adamw")])
def test_split_trains_to_the_unsplit_parameters(tmp_path, hp, ranks, rule):
    opt = {"name": rule, "learning_rate": LR[rule]}
    whole = gpt_run(tmp_path, "hp1", distributed={"num_ranks": ranks // hp}, optimizer=opt)
    split = gpt_run(tmp_path, f"hp{hp}x{ranks // hp}", distributed={"num_ranks": ranks, "horizontal_parallel_size": hp},
                    optimizer=opt)
    out1, out2 = run_ranks(whole), run_ranks(split, timeout=300)
    assert out1.returncode == 0, out1.stdout
    assert out2.returncode == 0, out2.stdout
    p1, p2 = read_params(newest(whole)), read_params(newest(split))  # the split one's slices merged
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    initial = initial_parameters(whole)
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"hp {hp} on {ranks} ranks, {rule}: max |param diff| vs hp 1: {worst}; largest move in training {moved}")
    assert worst < ATOL[rule] and moved > 10 * ATOL[rule]  # the runs trained, and to the same place
    np.testing.assert_allclose(losses(out2.stdout), losses(out1.stdout), rtol=1e-5)
