"""The layout rule and the global-batch split: pure functions, no processes (cores, memory, model size passed in)."""

from __future__ import annotations

import json
import os

import pytest

from ortflow.config import ConfigError, config_from_dict, rank_config
from ortflow.launch.layout import (
    BatchPlan,
    Host,
    LayoutError,
    auto_layout,
    fixed_batch_dim,
    launch_layout,
    physical_cores,
    plan_batch,
    rank_memory_bytes,
    read_tuned,
    write_tuned,
)

GIB = 2**30


def test_auto_starts_one_single_threaded_rank_per_core():
    assert auto_layout(Host(8, 64 * GIB), 3_300_000).pair == (8, 1)
    assert auto_layout(Host(2, 20 * GIB), 3_300_000).pair == (2, 1)  # 2x1 beat 1x2 on the 2-core machine


def test_auto_stops_at_16_ranks_per_host_and_gives_the_rest_as_threads():
    # 16 x 1 was the fastest layout measured on the 32-CPU Xeon; more ranks per host were never measured to pay
    layout = auto_layout(Host(32, 128 * GIB), 3_300_000)
    assert layout.pair == (16, 2) and "at most 16 ranks per host" in layout.reason
    assert auto_layout(Host(64, 512 * GIB), 3_300_000).pair == (16, 4)


def test_auto_counts_physical_cores_not_smt_siblings():
    # The 32-CPU Xeon (GEMM 13.6x one CPU on 32 threads): 16 x 1 was its fastest layout measured.
    layout = auto_layout(Host(32, 128 * GIB, physical_cores=16), 3_300_000)
    assert layout.pair == (16, 1) and "16 physical cores of 32 CPUs" in layout.reason
    assert auto_layout(Host(32, 128 * GIB, physical_cores=16), 3_300_000, global_batch=24).pair == (12, 1)
    assert auto_layout(Host(8, 64 * GIB, physical_cores=None), 1000).pair == (8, 1)  # topology unknown: CPUs


def _topology(root, cpu: int, package: int, core: int) -> None:
    folder = root / f"cpu{cpu}" / "topology"
    folder.mkdir(parents=True)
    (folder / "physical_package_id").write_text(f"{package}\n")
    (folder / "core_id").write_text(f"{core}\n")


def test_physical_cores_counts_package_and_core_pairs(tmp_path):
    for cpu in range(8):  # 2 packages x 2 cores x 2 threads: core ids repeat across packages
        _topology(tmp_path, cpu, package=cpu // 4, core=cpu % 2)
    assert physical_cores(set(range(8)), tmp_path) == 4
    assert physical_cores({0, 2}, tmp_path) == 1  # siblings of one core
    assert physical_cores({0, 9}, tmp_path) is None  # cpu9 has no topology: unknown, not a guess


def test_auto_fits_replicas_and_optimizer_state_into_memory():
    params = 500_000_000  # 8 GB of parameters, gradients and AdamW moments per rank
    host = Host(32, 64 * GIB)
    layout = auto_layout(host, params)
    assert layout.ranks * rank_memory_bytes(params) <= 0.8 * host.memory_bytes
    assert (layout.ranks + 1) * rank_memory_bytes(params) > 0.8 * host.memory_bytes
    assert layout.threads == 32 // layout.ranks and "memory" in layout.reason


def test_auto_refuses_a_model_whose_replica_does_not_fit():
    with pytest.raises(LayoutError, match="one rank needs about .* GiB"):
        auto_layout(Host(8, 4 * GIB), 1_000_000_000)


def test_auto_picks_the_most_ranks_that_divide_the_global_batch():
    assert auto_layout(Host(16, 64 * GIB), 1000, global_batch=24).ranks == 12
    assert auto_layout(Host(16, 64 * GIB), 1000, global_batch=24, fixed_batch=4).ranks == 6
    assert auto_layout(Host(16, 64 * GIB), 1000, global_batch=24).threads == 1


def test_plan_keeps_samples_per_update_and_prefers_few_accumulation_steps():
    assert plan_batch(64, 2, max_batch=8) == BatchPlan(8, 4, 2)
    assert plan_batch(64, 4, max_batch=32) == BatchPlan(16, 1, 4)
    assert plan_batch(48, 2, max_batch=5) == BatchPlan(4, 6, 2)  # largest divisor of 24 that is <= 5
    for ranks in (1, 2, 3, 4, 6):
        assert plan_batch(48, ranks, max_batch=7).global_batch == 48


def test_plan_with_a_fixed_batch_dim_uses_exactly_it():
    assert plan_batch(32, 2, max_batch=99, fixed_batch=8) == BatchPlan(8, 2, 2)


def test_plan_refuses_with_the_nearest_valid_choices():
    with pytest.raises(LayoutError) as err:
        plan_batch(30, 4, max_batch=8)
    assert "global batch of 28 or 32" in str(err.value)
    assert "3 or 5 rank(s)" in str(err.value)  # 30 splits over 3 or 5 ranks, the counts nearest 4
    with pytest.raises(LayoutError, match="fixed batch dim 8: use a global batch of 32 or 48"):
        plan_batch(40, 2, max_batch=8, fixed_batch=8)


def test_fixed_batch_dim_from_train_inputs_and_merged_rows():
    gpt = [{"name": "input_ids", "shape": [8, 128]}, {"name": "labels", "shape": [1024]}]
    assert fixed_batch_dim(gpt, {"labels": 128}) == 8
    assert fixed_batch_dim([{"name": "x", "shape": ["batch", 8]}, {"name": "labels", "shape": ["batch"]}]) is None
    with pytest.raises(LayoutError, match="different batch sizes"):
        fixed_batch_dim([{"name": "a", "shape": [4, 2]}, {"name": "b", "shape": [8]}])


def _cfg(tmp_path, **train):
    raw = {"output_dir": str(tmp_path), "model": {"path": str(tmp_path / "m.onnx")}, "data": {"train": ["x.npz"]},
           "train": {"batch_size": 8, "num_train_steps": 10, **train}, "distributed": {"num_ranks": "auto"}}
    return config_from_dict(raw)


def _configured(tmp_path, shape=("batch", 8), params=1000):
    record = {"num_parameters": params, "train_inputs": [{"name": "x", "dtype": "float32", "shape": list(shape)}]}
    (tmp_path / "configure.json").write_text(json.dumps(record))


def test_rank_config_derives_batch_and_accumulation_and_keeps_the_run_length(tmp_path):
    _configured(tmp_path)
    cfg = _cfg(tmp_path, global_batch_size=32)
    one, two = rank_config(cfg, 1, tmp_path).train, rank_config(cfg, 2, tmp_path).train
    assert (one.batch_size, one.gradient_accumulation_steps, one.num_weight_updates) == (8, 4, 10)
    assert (two.batch_size, two.gradient_accumulation_steps, two.num_weight_updates) == (8, 2, 10)
    assert rank_config(rank_config(cfg, 2, tmp_path), 2, tmp_path).train == two  # ranks may resolve it again
    assert rank_config(_cfg(tmp_path), 2, tmp_path).train.batch_size == 8  # no global batch: unchanged
    six = rank_config(_cfg(tmp_path, global_batch_size=12), 2, tmp_path).train
    assert (six.batch_size, six.gradient_accumulation_steps) == (6, 1)
    assert six.resolved_eval_batch_size == 8  # the config's: the batches ortflow evaluate forms


def test_a_fixed_batch_model_evaluates_in_batches_of_its_fixed_dim_under_a_global_batch(tmp_path):
    """batch_size is the most a rank takes under a global batch; a model that fixes its batch dim at 4 trains and
    evaluates in batches of 4 (ortflow evaluate too: config.eval_batch), not of the 8 written."""
    from ortflow.config import eval_batch

    _configured(tmp_path, shape=(4, 8))
    cfg = _cfg(tmp_path, global_batch_size=16)
    ranks = rank_config(cfg, 2, tmp_path).train
    assert (ranks.batch_size, ranks.gradient_accumulation_steps, ranks.resolved_eval_batch_size) == (4, 2, 4)
    assert eval_batch(cfg, tmp_path) == 4
    assert eval_batch(_cfg(tmp_path, global_batch_size=16, eval_batch_size=4), tmp_path) == 4


def test_rank_config_refuses_batches_the_models_fixed_batch_dim_cannot_take(tmp_path):
    # Each rank checks before the engine sees a batch (a config.yaml whose batch changed after configure, by
    # --accept-changed-config or a configure whose prepare-data then failed): not a shape error mid-update.
    _configured(tmp_path, shape=(4, 8))
    with pytest.raises(LayoutError, match=r"train.batch_size 8 does not fit the model's fixed batch dim of 4"):
        rank_config(_cfg(tmp_path), 1, tmp_path)
    with pytest.raises(LayoutError, match=r"train.eval_batch_size 8 does not fit"):
        rank_config(_cfg(tmp_path, batch_size=4, eval_batch_size=8), 1, tmp_path)
    assert rank_config(_cfg(tmp_path, batch_size=4), 1, tmp_path).train.batch_size == 4
    assert rank_config(_cfg(tmp_path, global_batch_size=16), 2, tmp_path).train.batch_size == 4  # split to fit


def test_launch_layout_auto_uses_the_tuned_winner_for_the_same_host(tmp_path):
    _configured(tmp_path)
    host = Host(4, 16 * GIB)
    cfg = _cfg(tmp_path)
    assert launch_layout(cfg, tmp_path, host)[0].pair == (4, 1)
    write_tuned(tmp_path, host, [{"ranks": 4, "threads": 1, "samples_per_s": 10.0},
                                 {"ranks": 2, "threads": 2, "samples_per_s": 12.5}])  # fmt: skip
    assert read_tuned(tmp_path, host).pair == (2, 2)
    assert launch_layout(cfg, tmp_path, host)[0].pair == (2, 2)
    assert read_tuned(tmp_path, Host(8, 16 * GIB)) is None  # another host size: the rule, not this record
    assert launch_layout(cfg, tmp_path, host, ranks=3)[0].pair == (3, 1)


def test_launch_layout_refuses_a_global_batch_the_fixed_batch_dim_cannot_split(tmp_path):
    _configured(tmp_path, shape=(8, 8))
    with pytest.raises(LayoutError, match="fixed batch dim 8"):
        launch_layout(_cfg(tmp_path, global_batch_size=24), tmp_path, Host(4, 16 * GIB), ranks=2)
    layout, plan = launch_layout(_cfg(tmp_path, global_batch_size=24), tmp_path, Host(4, 16 * GIB))
    assert (layout.ranks, plan) == (3, BatchPlan(8, 1, 3))  # auto: the most ranks <= 4 that 24 / 8 allows


def test_config_checks_global_batch_against_fixed_ranks_and_accumulation(tmp_path):
    with pytest.raises(ConfigError, match="cannot be split over distributed.num_ranks 4: use 28 or 32"):
        config_from_dict({"output_dir": str(tmp_path), "model": {"path": "m.onnx"}, "data": {"train": ["x"]},
                          "train": {"batch_size": 8, "num_train_steps": 10, "global_batch_size": 30},
                          "distributed": {"num_ranks": 4}})  # fmt: skip
    with pytest.raises(ConfigError, match="derived from train.global_batch_size"):
        _cfg(tmp_path, global_batch_size=32, gradient_accumulation_steps=2, num_train_steps=10)


def test_tune_candidates_add_one_rank_per_cpu_where_the_rule_starts_fewer():
    from ortflow.launch.tune import candidates

    smt = [c.pair for c in candidates(Host(32, 128 * GIB, physical_cores=16), 3_300_000, None, None)]
    assert smt == [(16, 1), (32, 1), (8, 4), (4, 8), (2, 16), (1, 32)]
    plain = [c.pair for c in candidates(Host(4, 16 * GIB), 3_300_000, None, None)]
    assert plain == [(4, 1), (2, 2), (1, 4)]
    capped = [c.pair for c in candidates(Host(32, 128 * GIB), 3_300_000, None, None)]
    assert capped == [(16, 2), (32, 1), (8, 4), (4, 8), (2, 16), (1, 32)]


def test_tune_candidates_of_a_split_model_start_whole_replicas_that_split_the_global_batch():
    from ortflow.launch.tune import candidates

    pipeline = [c.pair for c in candidates(Host(8, 64 * GIB), 3_300_000, None, None, split=2)]
    assert pipeline == [(8, 1), (4, 2), (2, 4)]
    odd = [c.pair for c in candidates(Host(6, 64 * GIB), 3_300_000, None, None, split=4)]
    assert odd == [(4, 1)]  # 6 cores: one replica of 4 ranks, the rest idle
    # A global batch of 8 over replicas of 2 ranks: 1, 2 or 4 replicas, never 3 (6 ranks would split it 8/3).
    batch = [c.pair for c in candidates(Host(6, 64 * GIB), 3_300_000, 8, None, split=2)]
    assert batch == [(4, 1), (2, 3)]


@pytest.mark.parametrize(
    ("choice", "local_size", "threads", "cores", "spins"),
    [("auto", 16, 2, 32, False),  # several ranks fill the host: sleep
     ("auto", 32, 1, 32, False),
     ("auto", 1, 32, 32, True),   # one rank alone keeps the engine's default
     ("auto", 2, 4, 32, True),    # spare cores: spinning costs no other rank
     ("on", 16, 2, 32, True),
     ("off", 1, 4, 32, False)],
)  # fmt: skip
def test_thread_spinning_rule_and_the_engine_option_it_sets(tmp_path, choice, local_size, threads, cores, spins):
    from ortflow.trainer.runtime import session_options, spin_wait

    cfg = config_from_dict({"output_dir": str(tmp_path), "model": {"path": str(tmp_path / "m.onnx")},
                            "data": {"train": ["x.npz"]}, "train": {"batch_size": 8, "num_train_steps": 10},
                            "distributed": {"thread_spinning": choice}})  # fmt: skip
    assert spin_wait(cfg, local_size, threads, cores) is spins
    options, entry = session_options(threads, spin=spins), "session.intra_op.allow_spinning"
    if spins:  # the engine's default (spinning) is left alone: no entry
        with pytest.raises(RuntimeError, match="does not have configuration"):
            options.get_session_config_entry(entry)
    else:
        assert options.get_session_config_entry(entry) == "0"


def test_the_launcher_environment_names_this_process_for_the_ranks_to_follow():
    import socket

    from ortflow import protocol
    from ortflow.launch import local

    env = local.launcher_environment()
    assert int(env[protocol.LAUNCHER_PID_ENV]) == os.getpid()
    assert env[protocol.LAUNCHER_HOST_ENV] == socket.gethostname()


def test_launch_layout_splits_a_global_batch_over_the_replicas_as_the_ranks_do(tmp_path):
    _configured(tmp_path, shape=(4, 8))  # a fixed batch dim of 4
    raw = _cfg(tmp_path, global_batch_size=8).model_dump(mode="json")
    raw["distributed"] = {"num_ranks": 4, "pipeline_parallel_size": 2}
    cfg = config_from_dict(raw)
    _, plan = launch_layout(cfg, tmp_path, Host(4, 16 * GIB))
    # 4 ranks = 2 stages x 2 replicas: each replica takes 4 rows, as rank_config gives every rank.
    assert (plan.ranks, plan.batch_size, plan.accumulation) == (2, 4, 1)
    assert rank_config(cfg, 2, tmp_path).train.batch_size == 4


def _split_cfg(tmp_path, **distributed):
    raw = _cfg(tmp_path).model_dump(mode="json")
    raw["distributed"] = {"num_ranks": "auto", **distributed}
    return config_from_dict(raw)


def test_auto_starts_whole_replicas_of_a_split_model(tmp_path):
    _configured(tmp_path)
    pp_tp = _split_cfg(tmp_path, pipeline_parallel_size=2, horizontal_parallel_size=2)
    # 2 cores, replicas of 4 ranks: one replica sharing the cores, not the rule's 2 ranks every rank would refuse.
    layout, _ = launch_layout(pp_tp, tmp_path, Host(2, 16 * GIB))
    assert layout.pair == (4, 1) and "whole replicas of pipeline x tensor-parallel 4 rank(s)" in layout.reason
    assert launch_layout(pp_tp, tmp_path, Host(6, 16 * GIB))[0].pair == (4, 1)  # 6 cores: one replica of 4
    assert launch_layout(pp_tp, tmp_path, Host(8, 16 * GIB))[0].pair == (8, 1)  # the rule's ranks: 2 replicas
    tp = _split_cfg(tmp_path, horizontal_parallel_size=2)
    assert launch_layout(tp, tmp_path, Host(3, 16 * GIB))[0].pair == (2, 1)


def test_a_tuned_winner_counts_the_replicas_of_a_split_model(tmp_path):
    _configured(tmp_path)
    host = Host(4, 16 * GIB)
    write_tuned(tmp_path, host, [{"ranks": 4, "threads": 1, "samples_per_s": 10.0}])
    raw = _cfg(tmp_path, global_batch_size=2).model_dump(mode="json")
    raw["distributed"] = {"num_ranks": "auto", "horizontal_parallel_size": 2}
    # 4 ranks at tp 2 are 2 replicas, which split a global batch of 2: the winner stays.
    assert launch_layout(config_from_dict(raw), tmp_path, host)[0].reason.startswith("tuned: ")
    write_tuned(tmp_path, host, [{"ranks": 3, "threads": 1, "samples_per_s": 10.0}])  # not whole tp-2 replicas
    layout, _ = launch_layout(config_from_dict(raw), tmp_path, host)
    assert layout.ranks % 2 == 0 and not layout.reason.startswith("tuned: ")


def test_a_rank_count_that_does_not_make_whole_replicas_is_refused_before_any_rank_starts(tmp_path):
    _configured(tmp_path)
    tp = _split_cfg(tmp_path, horizontal_parallel_size=2)
    with pytest.raises(LayoutError) as refused:
        launch_layout(tp, tmp_path, Host(4, 16 * GIB), ranks=3)
    assert str(refused.value) == ("3 rank(s) (--np) do not make whole replicas of pipeline_parallel_size 1 x "
                                  "horizontal_parallel_size 2 = 2 rank(s): use a multiple of 2 (2, 4, 6, ...)")
    assert launch_layout(tp, tmp_path, Host(4, 16 * GIB), ranks=4)[0].pair == (4, 1)


def test_cuda_ranks_sharing_a_host_get_one_engine_thread_each_unless_told(tmp_path):
    from ortflow.trainer.startup import threads_per_rank

    def cfg(**dist):
        raw = {"output_dir": str(tmp_path), "model": {"path": str(tmp_path / "m.onnx")}, "data": {"train": ["x.npz"]},
               "train": {"batch_size": 8, "num_train_steps": 10}, "distributed": {"num_ranks": 4, **dist}}
        if raw["distributed"].get("device") == "cuda":
            raw["distributed"]["use_nccl"] = True
        return config_from_dict(raw)

    host = Host(64, 512 * GIB)
    assert launch_layout(cfg(device="cuda"), tmp_path, host)[0].pair == (4, 1)
    assert launch_layout(cfg(), tmp_path, host)[0].pair == (4, 16)  # CPU ranks share the cores
    assert launch_layout(cfg(device="cuda", threads_per_rank=8), tmp_path, host)[0].pair == (4, 8)
    assert launch_layout(cfg(device="cuda"), tmp_path, host, threads=2)[0].pair == (4, 2)
    # the ranks' own choice when no launcher set it (a bare mpiexec), and one CUDA rank keeps the host's cores
    assert threads_per_rank(cfg(device="cuda"), 4, 64, environ={}) == 1
    assert threads_per_rank(cfg(device="cuda"), 1, 64, environ={}) == 64
    assert threads_per_rank(cfg(), 4, 64, environ={}) == 16
    assert threads_per_rank(cfg(device="cuda"), 4, 64, environ={"ORTFLOW_THREADS_PER_RANK": "3"}) == 3


def test_auto_on_cuda_starts_one_rank_per_visible_gpu_and_refuses_a_host_without_one(tmp_path):
    _configured(tmp_path)

    def cfg(**more):
        raw = {"output_dir": str(tmp_path), "model": {"path": str(tmp_path / "m.onnx")}, "data": {"train": ["x.npz"]},
               "train": {"batch_size": 8, "num_train_steps": 10, **more},
               "distributed": {"num_ranks": "auto", "device": "cuda", "use_nccl": True}}
        return config_from_dict(raw)

    layout, _ = launch_layout(cfg(), tmp_path, Host(64, 512 * GIB, gpus=4))
    assert layout.pair == (4, 1) and layout.reason == "auto: one rank per GPU, 4 visible on this host"
    assert launch_layout(cfg(), tmp_path, Host(64, 512 * GIB, gpus=1))[0].pair == (1, 64)  # alone: the host's cores
    _, plan = launch_layout(cfg(global_batch_size=64), tmp_path, Host(64, 512 * GIB, gpus=4))
    assert (plan.batch_size, plan.accumulation) == (8, 2)  # 64 samples over 4 GPU ranks of 8
    with pytest.raises(LayoutError, match=r"auto with device cuda starts one rank per GPU, but no GPU is visible"):
        launch_layout(cfg(), tmp_path, Host(64, 512 * GIB, gpus=0))


def test_tune_refuses_cuda_runs_before_configuring_anything(tmp_path):
    from typer.testing import CliRunner

    from ortflow.cli import app
    from tests.test_validate import setup

    path = setup(tmp_path, distributed={"device": "cuda", "use_nccl": True, "num_ranks": "auto"})
    result = CliRunner().invoke(app, ["tune", str(path)])
    assert result.exit_code == 1, result.output
    assert "ortflow tune times CPU layouts" in result.output and "one rank per GPU" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # no configure, no prepare-data


def test_tune_says_when_the_config_will_not_start_its_winner_or_trains_another_batch_on_it():
    from ortflow.launch.tune import tune_notes

    def cfg(**dist_train):
        raw = {"output_dir": "/tmp/x", "model": {"path": "m.onnx"}, "data": {"train": ["a.npz"]},
               "train": {"batch_size": 16, "num_train_steps": 4, **dist_train.get("train", {})},
               "distributed": dist_train.get("distributed", {"num_ranks": "auto"})}
        return config_from_dict(raw)

    per_rank = {"candidates": [{"ranks": 2, "threads": 1, "samples_per_update": 32},
                               {"ranks": 1, "threads": 2, "samples_per_update": 16}],
                "best": {"ranks": 1, "threads": 2, "samples_per_update": 16}}
    fixed = {"candidates": [{**c, "samples_per_update": 32} for c in per_rank["candidates"]],
             "best": {**per_rank["best"], "samples_per_update": 32}}
    (fixed_ranks,) = tune_notes(cfg(distributed={"num_ranks": 2}, train={"global_batch_size": 32}), fixed)
    assert "distributed.num_ranks is 2" in fixed_ranks and "distributed.num_ranks: auto" in fixed_ranks
    (batch,) = tune_notes(cfg(), per_rank)
    assert "16 samples per weight update" in batch and "train.global_batch_size" in batch
    assert tune_notes(cfg(train={"global_batch_size": 32}), fixed) == []


def test_the_layout_line_names_each_factor_of_the_global_batch():
    # `ortflow train` printed "2 x 16 x 2 steps = 64": which number was which, and 64 of what?
    assert BatchPlan(16, 2, 2).describe() == "2 replica(s) x 16 samples x 2 micro-batch(es) = 64 samples per update"
