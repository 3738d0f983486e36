"""Run in a fresh process (the engine's shared arena is process-wide): gradients of the same artifacts with a session's
own arena, then with the trainer's shared arena; prints both counts of memory runs."""

import sys
from pathlib import Path

from ortflow.engine import api
from ortflow.trainer.arena import use_gradient_arena
from ortflow.trainer.comm.memory_runs import local_runs
from ortflow.trainer.runtime import session_options

folder = Path(sys.argv[1])


def runs(shared: bool) -> tuple[int, object]:
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    options = session_options(1)
    if shared:
        options = use_gradient_arena(options, 4 * sum(p.data.size for _, p in state.parameters if p.requires_grad))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                        session_options=options)  # fmt: skip
    grads = [state.parameters[n].grad for n in sorted(n for n, p in state.parameters if p.requires_grad)]
    return len(local_runs([g.__array_interface__["data"][0] for g in grads], [g.size for g in grads])), module


own, keep = runs(False)
shared, keep2 = runs(True)
print(f"RUNS own {own} shared {shared}", flush=True)
