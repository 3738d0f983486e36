"""bench_tensor's contenders, summary and report: hp2 keeping its activations against hp2-recompute, medians over
rounds of the slowest rank, samples/s, and what a GPU record says."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import bench_tensor
from bench.bench_tensor import report, summarize

MEMORY = {"split_parameters": 8, "split_gradients": 8, "split_optimizer_state": 16, "all_parameters": 10,
          "optimizer_state_total": 20}
HALF = {"split_parameters": 4, "split_gradients": 4, "split_optimizer_state": 8, "all_parameters": 6,
        "optimizer_state_total": 12}


def _rank(step: float, sums: float = 0.0, calls: float = 0.0, samples: int = 16, memory=MEMORY, kept: int = 0) -> dict:
    return {"step_s": step, "allreduce_s": sums, "engine_calls_s": calls, "samples_per_step": samples,
            "memory": memory, "kept_parts": kept}


def test_summary_takes_each_rounds_slowest_rank_and_the_median_round():
    results = {"hp1": [[_rank(0.033)], [_rank(0.032)], [_rank(0.040)]],
               "dp2": [[_rank(0.036, samples=32), _rank(0.037, samples=32)]] * 3,
               "hp2": [[_rank(0.054, 0.009, 0.042, memory=HALF), _rank(0.056, 0.008, 0.043, memory=HALF)],
                       [_rank(0.055, 0.009, 0.042, memory=HALF), _rank(0.053, 0.009, 0.041, memory=HALF)],
                       [_rank(0.070, 0.010, 0.050, memory=HALF), _rank(0.060, 0.009, 0.045, memory=HALF)]]}
    summary = summarize(results)
    assert summary["timing"]["hp1"]["step_s"] == pytest.approx(0.033)
    assert summary["timing"]["hp2"]["step_s"] == pytest.approx(0.056)  # rounds' slowest ranks 0.056, 0.055, 0.070
    assert summary["timing"]["dp2"]["samples_per_s"] == pytest.approx(32 / 0.037)
    assert summary["memory_ratio_vs_hp1"]["hp2 rank 0"]["split_parameters"] == 0.5
    assert "hp2_kept_vs_recompute" not in summary  # no recomputing contender in these results
    record = {"command": "python -m bench tensor --device cuda", "host": "h", "cores": 64, "shape": {"d_model": 2048},
              "batch_size": 8, "micro": 2, "device": "cuda", "gpus": "4 x NVIDIA H100", "summary": summary}
    text = report(record)
    assert text.startswith("# Tensor parallelism on GPUs (h, 64 cores)")
    assert "GPUs: 4 x NVIDIA H100" in text and "batch 8 x 2 micro-batches" in text
    assert summary["timing"]["hp2"]["engine_calls_s"] == pytest.approx(0.043)  # each round's slowest rank's median
    assert "| hp2 | 0.056 | 285.7 | 0.009 | 0.043 |" in text and "hp2 step time / hp1: 1.70" in text
    assert report({**record, "device": "cpu", "gpus": None}).startswith("# Tensor parallelism on CPU ranks")
    assert "deterministic_compute: false" not in text
    assert "Every contender with `distributed.deterministic_compute: false`." in report(
        {**record, "deterministic_compute": False})


def test_nondeterministic_is_for_gpus_and_configures_every_contender_without_deterministic_compute(monkeypatch):
    with pytest.raises(SystemExit) as refused:
        bench_tensor.main(["--nondeterministic"])
    assert refused.value.code == 2
    configs = []
    monkeypatch.setattr(bench_tensor, "_inputs", lambda root: (root / "gpt.onnx", root / "corpus.txt"))
    monkeypatch.setattr("ortflow.configure.configure.configure", lambda cfg: configs.append(cfg))
    monkeypatch.setattr("ortflow.dataprep.prepare_data", lambda cfg: None)
    monkeypatch.setitem(bench_tensor.RUN, "device", "cuda")
    for deterministic in (True, False):
        monkeypatch.setitem(bench_tensor.RUN, "deterministic", deterministic)
        bench_tensor._configure(Path("/nonexistent-root"), "hp2", 2, 2)
        assert configs[-1].distributed.deterministic_compute is deterministic


def test_hp2_keeping_is_set_against_hp2_recomputing_round_by_round():
    hp2 = [[_rank(0.050, 0.009, 0.040, memory=HALF, kept=19), _rank(0.052, 0.009, 0.041, memory=HALF, kept=19)],
           [_rank(0.060, 0.009, 0.050, memory=HALF, kept=19), _rank(0.058, 0.009, 0.048, memory=HALF, kept=19)],
           [_rank(0.050, 0.009, 0.040, memory=HALF, kept=19), _rank(0.050, 0.009, 0.040, memory=HALF, kept=19)]]
    recompute = [[_rank(0.065, 0.009, 0.052, memory=HALF), _rank(0.064, 0.009, 0.051, memory=HALF)],
                 [_rank(0.060, 0.009, 0.050, memory=HALF), _rank(0.060, 0.009, 0.050, memory=HALF)],
                 [_rank(0.080, 0.009, 0.070, memory=HALF), _rank(0.080, 0.009, 0.070, memory=HALF)]]
    results = {"hp1": [[_rank(0.033)]] * 3, "dp2": [[_rank(0.036, samples=32)] * 2] * 3, "hp2": hp2,
               "hp2-recompute": recompute}
    summary = summarize(results)
    ratio = summary["hp2_kept_vs_recompute"]
    # Paired per round (slowest rank): steps 0.052/0.065, 0.060/0.060, 0.050/0.080; engine 0.041/0.052, ...
    assert ratio["step_s"] == pytest.approx(0.052 / 0.065) and ratio["rounds"] == 3
    assert ratio["engine_calls_s"] == pytest.approx(0.041 / 0.052)
    assert summary["timing"]["hp2-recompute"]["step_s"] == pytest.approx(0.065)
    text = report({"command": "python -m bench tensor", "host": "h", "cores": 2, "shape": {}, "batch_size": 4,
                   "summary": summary})
    assert "| hp2 | 0.052 | 307.7 | 0.009 | 0.041 | 19, 19 |" in text
    assert "| hp2-recompute | 0.065 | 246.2 | 0.009 | 0.052 | 0, 0 |" in text
    assert "hp2 (keeping) / hp2-recompute, paired within each of 3 rounds, median: step time 0.80x, engine calls " \
           "0.79x" in text


def test_hp2_recompute_is_hp2_with_recompute_forward_on_hp2s_artifacts(tmp_path, monkeypatch):
    """The contenders' configs: hp2-recompute asks for recompute_forward and takes hp2's artifacts and shards (hard
    links that configure and prepare-data verified and reused); dp2 takes hp1's."""
    monkeypatch.setitem(bench_tensor.SHAPE, "d_model", 32)
    monkeypatch.setitem(bench_tensor.SHAPE, "num_heads", 2)
    monkeypatch.setitem(bench_tensor.SHAPE, "num_layers", 1)
    monkeypatch.setitem(bench_tensor.SHAPE, "seq_len", 16)
    (tmp_path / "corpus.txt").write_text("the contenders train on the same text. " * 200)
    runs = bench_tensor.configure_contenders(tmp_path)
    assert {name: ranks for name, (_, ranks) in runs.items()} == {"hp1": 1, "dp2": 2, "hp2": 2, "hp2-recompute": 2}

    def distributed(name: str) -> dict:
        return yaml.safe_load((runs[name][0] / "config.yaml").read_text())["distributed"]

    assert distributed("hp2-recompute")["recompute_forward"] is True
    assert distributed("hp2-recompute")["horizontal_parallel_size"] == 2
    assert distributed("hp2")["recompute_forward"] is False and distributed("hp1")["recompute_forward"] is False
    for name, source, parts in (("hp2-recompute", "hp2", ["artifacts/tensor/tensor.json"]),
                                ("dp2", "hp1", ["artifacts/training_model.onnx"])):
        for part in [*parts, "artifacts/checkpoint", "data/manifest.json"]:
            linked, original = runs[name][0] / part, runs[source][0] / part
            assert linked.exists() and linked.stat().st_ino == original.stat().st_ino, (name, part)
    record = yaml.safe_load((runs["hp2-recompute"][0] / "configure.json").read_text())
    assert record["artifacts_dir"] == str(runs["hp2-recompute"][0] / "artifacts")  # configure recorded its place
    assert bench_tensor.configure_contenders(tmp_path) == runs  # configured folders are reused as they are
    # --contenders hp1,hp2: only those two (a shorter call on a lent GPU machine)
    assert bench_tensor.configure_contenders(tmp_path, {"hp1", "hp2"}) == {k: runs[k] for k in ("hp1", "hp2")}


def test_contenders_names_the_unknown_and_runs_hp1_and_hp2_always(monkeypatch):
    with pytest.raises(SystemExit) as refused:
        bench_tensor.main(["--contenders", "hp1,hp3"])
    assert refused.value.code == 2
    seen = []
    monkeypatch.setattr(bench_tensor, "configure_contenders", lambda root, names: seen.append(names) or {})
    monkeypatch.setattr(bench_tensor, "_split_names", lambda folder: [])
    with pytest.raises(KeyError):  # no run folders came back: the stub stops the call after configuring
        bench_tensor.main(["--contenders", "dp2", "--rounds", "0"])
    assert seen == [{"hp1", "hp2", "dp2"}]


class _Clock:
    """A stream whose events carry the GPU time at which they would complete (set by the test)."""

    def __init__(self):
        self.now, self.synchronized = 0.0, 0

    def record(self):
        return self.now

    def synchronize(self):
        self.synchronized += 1


def test_gpu_timeline_sums_each_kinds_intervals_and_counts_the_streams_idle_time():
    clock = _Clock()
    timeline = bench_tensor.GpuTimeline(clock)

    def work(ms):
        def call():
            clock.now += ms
            return ms
        return call

    fw, bw, total = timeline.wrap(work(5.0), "fw0"), timeline.wrap(work(7.0), "bw0"), timeline.wrap(work(2.0), "sum")
    assert fw() == 5.0 and total() == 2.0  # the wrapped calls return what they return
    clock.now += 10.0  # the stream idles: the loss piece's training call, on the module's own stream
    assert bw() == 7.0 and total() == 2.0
    ms = timeline.take(lambda a, b: b - a)
    assert ms == {"fw0": 5.0, "sum": 4.0, "bw0": 7.0, "work": 16.0, "span": 26.0}
    assert clock.synchronized == 1 and timeline.marks == []  # read after the stream's work is done, then cleared
    line = bench_tensor.gpu_line({**ms, "fw1": 1.0, "module": 9.5})
    assert line.startswith("GPU ms: forwards 6.0, backwards 7.0, sums 4.0, engine stream idle 10.0 of a 26.0 span")
    assert "9.5 on the host" in line and bench_tensor.gpu_line(None) == ""


def test_the_report_gives_each_hp2_ranks_gpu_timeline_when_recorded():
    rank = {**_rank(0.05, memory=HALF), "rank": 1, "gpu_ms": {"fw0": 3.0, "bw0": 4.0, "sum": 1.0, "work": 8.0,
                                                                "span": 9.0, "module": 0.5}}
    results = {"hp1": [[_rank(0.04)]], "hp2": [[{**rank, "rank": 0}, rank]]}
    record = {"command": "c", "host": "h", "cores": 2, "shape": {}, "batch_size": 8, "device": "cuda", "gpus": "g",
              "summary": summarize(results), "raw": results}
    text = report(record)
    assert "- hp2 rank 1: GPU ms: forwards 3.0, backwards 4.0, sums 1.0, engine stream idle 1.0 of a 9.0 span" in text
    assert "GPU timeline" not in report({**record, "raw": {"hp1": results["hp1"], "hp2": [[_rank(0.05)]]}})


@pytest.mark.parametrize("deterministic", [True, False])
def test_engine_calls_configures_its_gpu_runs_as_the_flag_says(tmp_path, monkeypatch, deterministic):
    """``bench engine-calls --device cuda --nondeterministic`` measures what a run without deterministic compute
    trains: configured with ``deterministic_compute: false``, so its training graph keeps the engine's ReduceSums
    (no MatMul rewrite in either contender)."""
    from bench import engine_calls
    from ortflow.configure.training_graph import sums_as_matmul_applies

    configs = []
    monkeypatch.setattr("ortflow.configure.configure.configure", lambda cfg: configs.append(cfg))
    monkeypatch.setattr("ortflow.dataprep.prepare_data", lambda cfg: None)
    engine_calls._configure(tmp_path, "gpt2", 2, "cuda", deterministic)
    (cfg,) = configs
    assert cfg.distributed.deterministic_compute is deterministic
    assert sums_as_matmul_applies(cfg) is deterministic
