"""The exchange seam is typed: every exchange declares its capabilities, and the rank models read them instead of
probing the exchange or the communicator with hasattr."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import ortflow.trainer
from ortflow.trainer.comm import MPIComm, NCCLComm, SingleProcessComm
from ortflow.trainer.optim.adasum_update import AdasumExchange
from ortflow.trainer.optim.device import AdasumDevice, Zero1Device
from ortflow.trainer.optim.exchange import Exchange
from ortflow.trainer.optim.zero import Zero0, Zero1

TRAINER = Path(ortflow.trainer.__file__).parent


@pytest.mark.parametrize(
    ("exchange", "sharded", "per_rank_state", "averages"),
    [(Zero0, False, False, True), (Zero1, True, True, False), (Zero1Device, True, True, False),
     (AdasumExchange, False, False, False), (AdasumDevice, False, False, False)],
)
def test_every_exchange_declares_its_capabilities_and_the_calls_of_an_update(exchange, sharded, per_rank_state,
                                                                             averages):
    assert exchange.sharded is sharded and exchange.per_rank_state is per_rank_state
    assert exchange.averages is averages
    for call in ("reduce", "norm", "scale", "gather", "sum_across_ranks", "names"):
        assert callable(getattr(exchange, call)), call
    assert set(Exchange.__annotations__) == {"sharded", "per_rank_state", "averages"}


def test_a_sharded_exchange_names_the_parameter_of_each_range_it_returns():
    params = [np.zeros(3, np.float32), np.zeros(5, np.float32)]
    whole = Zero0(SingleProcessComm())
    assert whole.names(["a", "b"]) == ["a", "b"]
    # Rank 1 of 2 holds elements 4..7 of the packed 8: the last 4 of "b".
    shard = Zero1(SingleProcessComm(), ["a", "b"], params, rank=1, world=2)
    assert shard.names(["a", "b"]) == ["b"]


def test_adasum_keeps_each_ranks_optimizer_state_only_when_it_combines_updates():
    params = [np.zeros(4, np.float32)]
    assert AdasumExchange(SingleProcessComm(), params, "deltas").per_rank_state
    assert not AdasumExchange(SingleProcessComm(), params, "gradients").per_rank_state


def test_zero0_defers_the_mean_only_to_a_communicator_that_can_leave_it():
    host = SingleProcessComm()
    assert Zero0(host, fold=True).defers and host.defer_scale
    assert not Zero0(SingleProcessComm(), fold=False).defers
    assert NCCLComm.can_defer_scale is False and MPIComm.can_defer_scale is True


@pytest.mark.parametrize("module", ["rank_model.py", "runtime.py", "loop.py", "parallel/layout_model.py",
                                    "parallel/build.py", "parallel/whole_model.py", "parallel/pipeline_stage.py",
                                    "parallel/tensor_parallel_body.py", "tune_updates.py"])
def test_rank_models_and_the_loop_probe_nothing_with_hasattr(module):
    tree = ast.parse((TRAINER / module).read_text())
    probes = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id == "hasattr"]
    assert not probes, f"{module}: hasattr at lines {probes}"
