"""Training with 2 intra-op threads per rank is repeatable (ortflow/graph/gradients/embedding.py): 2 ranks under
``mpiexec`` train a byte-level GPT whose token table the CPU engine's GatherGrad would sum in thread order.

The model is the size at which the engine's own Gather gradient was measured to differ run to run with 2 threads
(vocab 256, T 16, d 64, 2 layers, 16 sequences per rank), on text, where byte
ids repeat many times per batch.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime
import pytest

from ortflow.checkpoints import list_complete
from ortflow.examples.gpt import build_gpt
from ortflow.export import export_model
from tests.support.runs import checkpoint_parameters, final_parameters, kill_and_resume, make_text_run

pytestmark = pytest.mark.mpi

DISTRIBUTED = {"num_ranks": 2, "threads_per_rank": 2}


def _text_run(root, name, steps, period):
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "gpt.onnx").exists():  # make_text_run uses it as it finds it
        build_gpt(root / "gpt.onnx", vocab_size=256, seq_len=16, d_model=64, num_layers=2, num_heads=2)
    return make_text_run(root, name, distributed=DISTRIBUTED,
                         train={"batch_size": 16, "num_train_steps": steps, "display_loss_steps": 5},
                         checkpoint={"period": period, "max_num_checkpoints": 10})


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


STEPS, PERIOD = 80, 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the same config, every checkpoint kept: ``steady`` uninterrupted, ``killed`` SIGKILLed after 30
    updates and resumed. The killed run's checkpoints before the kill come from a second run from scratch (the
    repeatability case); those after it from the resumed process (the resume case)."""
    root = tmp_path_factory.mktemp("embedding")
    steady, killed = _text_run(root, "steady", STEPS, PERIOD), _text_run(root, "killed", STEPS, PERIOD)
    resumed = kill_and_resume(killed, min_step=30, end_step=STEPS, timeout=300, beside=steady)
    return steady, killed, int(re.findall(r"starting from step (\d+)", resumed)[0])


def _checkpoints(cfg) -> dict[int, dict]:
    return {info.step: checkpoint_parameters(info.path) for info in list_complete(cfg.checkpoints_dir)}


def test_two_runs_with_two_threads_per_rank_are_bitwise_identical_and_export_the_users_graph(runs):
    first, second, resumed_from = runs
    ops = {n.op_type for n in onnx.load(str(first.artifacts_dir / "training_model.onnx")).graph.node}
    assert "GatherNDGrad" in ops and "GatherGrad" not in ops  # the token table's gradient is the repeatable one
    a, b = _checkpoints(first), _checkpoints(second)
    before = [step for step in b if step <= resumed_from]
    assert before and sorted(a) == sorted(b) == list(range(PERIOD, STEPS + 1, PERIOD))
    for step in before:  # written by the second run before it was killed: from scratch, as the first
        _assert_same(a[step], b[step])

    root = first.output_dir.parent
    exported = export_model(first.output_dir, root / "model.onnx").path
    model = onnx.load(str(exported))
    assert "GatherND" not in {n.op_type for n in model.graph.node}
    user = onnx.load(str(root / "gpt.onnx"))
    gathers = [(n.input[0], n.output[0]) for n in model.graph.node if n.op_type == "Gather"]
    assert gathers == [(n.input[0], n.output[0]) for n in user.graph.node if n.op_type == "Gather"]
    trained = final_parameters(first)
    for tensor in user.graph.initializer:  # the user's graph with the trained weights computes what export wrote
        if tensor.name in trained:
            tensor.CopyFrom(onnx.numpy_helper.from_array(trained[tensor.name], tensor.name))
    ids = np.random.default_rng(0).integers(0, 256, (2, 16))

    def logits(proto):
        session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run([model.graph.output[0].name], {"input_ids": ids})[0]

    assert np.array_equal(logits(model), logits(user))


def test_a_killed_run_with_two_threads_per_rank_resumes_bitwise_identical(runs):
    steady, killed, _ = runs
    _assert_same(final_parameters(steady), final_parameters(killed))
