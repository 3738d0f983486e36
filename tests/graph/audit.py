"""The gradient audit's measurement: the engine's gradients of many op branches against float64 central differences.

:func:`audit` builds one model of the given cases (tests/support/audit_graph.py), lets configure build the training
artifacts, runs one forward/backward, and compares every trained parameter's gradient with central differences of
the ORIGINAL model in float64 (each branch's own nodes, run by onnx's ReferenceEvaluator; the other branches'
logits held fixed, since a parameter of one branch changes only that branch's contribution).

Per case the result is the worst ``|engine - reference| / max|reference|`` over the case's tensors (sampled entries),
and the reference's own precision: the same differences with twice the step, which would differ by the truncation
and rounding errors of the differences themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from tests.graph.gradcheck import engine_loss_and_gradients, parameters_of, sample_indices, to_double
from tests.support.audit_graph import BATCH, CLASSES, FEATURES, Case, build_model

STEP = 1e-6
#: A float32 forward/backward of a branch is right to ~1e-7..1e-6 of its largest gradient; the opset-20 tanh Gelu's
#: wrong derivative was 2.3e-4 off.
BOUND = 2e-5


@dataclass(frozen=True)
class Finding:
    case: str
    worst: float  # max over the case's tensors of max|engine - reference| / max|reference|
    worst_tensor: str
    reference_noise: float  # the same measure between steps h and 2h of the reference


def _cross_entropy(logits: np.ndarray, labels: np.ndarray) -> float:
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(labels)), labels].mean())


def raw_artifacts(path: Path, out: Path) -> Path:
    """The engine's artifacts for the model as it is, without ortflow's passes (for the engine-fact tests)."""
    import os

    from ortflow.engine import artifacts

    model = onnx.load(str(path))
    out.mkdir(parents=True)
    here = os.getcwd()
    os.chdir(out)  # the generator writes a temporary file into the current folder
    try:
        # BatchNormalization's running statistics are never trained (ortflow freezes them too).
        stats = {i for n in model.graph.node if n.op_type == "BatchNormalization" for i in n.input[3:]}
        artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer
                                                           if t.name not in stats],
                                     loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=str(out))
    finally:
        os.chdir(here)
    return out


def audit(tmp_path: Path, cases: list[Case], count: int = 12, seed: int = 1, raw: bool = False,
          model_seed: int = 0) -> tuple[dict[str, Finding], dict]:
    """Each case's worst gradient error; and configure's info (its rewrites). ``raw``: the engine's artifacts of the
    model as it is (no configure, every initializer trained)."""
    path, branches = build_model(tmp_path / "audit.onnx", cases, seed=model_seed)
    if raw:
        artifacts_dir = raw_artifacts(path, tmp_path / "raw")
        stats = {i for n in onnx.load(str(path)).graph.node if n.op_type == "BatchNormalization" for i in n.input[3:]}
        info = {"frozen": sorted(stats), "graph_rewrites": []}
    else:
        cfg = config_from_dict({"output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                                "data": {"train": [str(tmp_path / "t.npz")]},
                                "train": {"batch_size": BATCH, "num_train_steps": 1}})
        result = configure(cfg)
        artifacts_dir, info = result.artifacts_dir, result.info
    rng = np.random.default_rng(seed)
    x, labels = rng.standard_normal((BATCH, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, BATCH)
    _, grads = engine_loss_and_gradients(artifacts_dir, [x, labels.astype(np.int64)])

    evaluators = {name: ReferenceEvaluator(to_double(m)) for name, m in branches.items()}
    params = {name: parameters_of(m) for name, m in branches.items()}
    feeds = {"x": x.astype(np.float64)}

    def contribution(name: str, values: dict[str, np.ndarray]) -> np.ndarray:
        return evaluators[name].run(None, {**feeds, **values})[0]

    base = {name: contribution(name, params[name]) for name in branches}
    total = sum(base.values())
    findings = {}
    for case in cases:
        name, own = case.name, params[case.name]
        rest = total - base[name]

        def loss(tensor: str, index: tuple[int, ...], delta: float, name=name, own=own, rest=rest) -> float:
            values = {k: v.copy() for k, v in own.items()}
            values[tensor][index] += delta
            return _cross_entropy(rest + contribution(name, values), labels)

        worst, worst_tensor, noise = 0.0, "", 0.0
        # Frozen initializers (BatchNormalization's running statistics) come back with an empty gradient.
        for tensor in sorted(t for t in own if t not in info["frozen"]):
            indices = sample_indices(own[tensor].shape, np.random.default_rng(0), count)
            want = np.array([(loss(tensor, i, STEP) - loss(tensor, i, -STEP)) / (2 * STEP) for i in indices])
            wide = (loss(tensor, indices[-1], 2 * STEP) - loss(tensor, indices[-1], -2 * STEP)) / (4 * STEP)
            got = np.array([grads[tensor][i] for i in indices], np.float64)
            scale = max(float(np.abs(want).max()), 1e-6)
            error = float(np.abs(got - want).max()) / scale
            noise = max(noise, abs(wide - want[-1]) / scale)
            if error >= worst:
                worst, worst_tensor = error, tensor
        findings[name] = Finding(name, worst, worst_tensor, noise)
    return findings, info


def main() -> None:
    """Print the audit's table (docs/engine.md): ``python -m tests.graph.audit``."""
    import logging
    import tempfile

    from tests.graph.test_gradient_audit import CHECKED

    logging.disable(logging.WARNING)
    print("| case | worst error | reference noise | verdict |\n|---|---|---|---|")
    for group, cases in CHECKED.items():
        with tempfile.TemporaryDirectory() as folder:
            findings, _ = audit(Path(folder), cases)
        for f in findings.values():
            verdict = "right" if f.worst < BOUND else "**WRONG**"
            print(f"| {f.case} ({group}) | {f.worst:.1e} | {f.reference_noise:.0e} | {verdict} |")


if __name__ == "__main__":
    main()
