"""``ortflow tune`` times the training loop's own weight updates on every layout: data-parallel replicas, pipeline
stages, tensor-parallel pieces and pipeline x tensor-parallel pieces (ranks under mpiexec, a 2-layer GPT)."""

from __future__ import annotations

import json

import pytest

from ortflow.launch.layout import Host, read_tuned
from ortflow.launch.tune import tune
from tests.support.parallel_runs import TRAIN, gpt_run

pytestmark = pytest.mark.mpi
GIB = 2**30

#: layout -> (distributed section, the host tune is told about, the candidates it must time as (ranks, threads))
LAYOUTS = {
    "dp": ({}, Host(2, 16 * GIB), [(2, 1), (1, 2)]),
    "pp": ({"pipeline_parallel_size": 2}, Host(2, 16 * GIB), [(2, 1)]),
    "tp": ({"horizontal_parallel_size": 2}, Host(2, 16 * GIB), [(2, 1)]),
    "pp_x_hp": ({"pipeline_parallel_size": 2, "horizontal_parallel_size": 2}, Host(4, 16 * GIB), [(4, 1)]),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tune")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tune_times_every_candidate_of_the_layout_and_records_the_fastest(root, name):
    dist, host, expected = LAYOUTS[name]
    cfg = gpt_run(root, name, distributed={"num_ranks": "auto", **dist}, checkpoint={"period": 0})
    record = json.loads(tune(cfg, host, updates=2, warmup=1).read_text())
    assert [(c["ranks"], c["threads"]) for c in record["candidates"]] == expected
    split = dist.get("pipeline_parallel_size", 1) * dist.get("horizontal_parallel_size", 1)
    for row in record["candidates"]:
        replicas = row["ranks"] // split  # one update's samples: micro-batches x replicas x batch
        assert row["samples_per_update"] == TRAIN["gradient_accumulation_steps"] * replicas * TRAIN["batch_size"]
        assert row["samples_per_s"] > 0 and row["update_s"] > 0
    best = max(record["candidates"], key=lambda c: c["samples_per_s"])
    assert read_tuned(cfg.output_dir, host).pair == (best["ranks"], best["threads"])
    assert not (cfg.output_dir / "checkpoints").exists()  # tuning trains in memory only
