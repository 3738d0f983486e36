"""The optimizer benches' checks and report logic (the timed runs themselves live in bench/, not in tests)."""

from __future__ import annotations

import json

import pytest

from bench import optim_cpu, optim_gpu


def test_ortflow_adamw_torch_rule_matches_real_torch_adamw(capsys):
    torch = pytest.importorskip("torch")  # the bench extra
    assert optim_cpu.torch_check_main(["--steps", "100"]) == 0
    out = capsys.readouterr().out
    worst = float(out.rsplit("=", 1)[1])
    assert worst <= 2e-5 and torch.__version__ in out


def test_optim_gpu_sizes_are_the_bench_gpt_of_bench_mixed():
    names, sizes = optim_gpu.gpt_sizes(8192, 768, 12)
    assert names == sorted(names) and len(names) == len(sizes)
    assert 97.5e6 < sum(sizes) < 98.1e6  # "97.8M parameters" (bench_mixed's docstring)


def test_optim_gpu_report_gives_percent_of_peak_and_of_copy():
    rows = [{"variant": "copy", "min_ms": 1.0, "median_ms": 1.0, "bytes_per_param": 28, "gb_s": 2800.0},
            {"variant": "adamw torch", "min_ms": 1.2, "median_ms": 1.25, "bytes_per_param": 28, "gb_s": 2240.0}]
    result = {"num_parameters": 10**8, "num_tensors": 3, "peak_bytes_s": 4.8e12, "peak_source": "H200: datasheet",
              "engine": "not run", "rounds": 5, "steps": 20, "rows": rows}
    text = optim_gpu.report(result)
    assert "| adamw torch | 1.200 | 1.250 | 28 | 2240 | 47% | 80% |" in text
    assert "| copy | 1.000 | 1.000 | 28 | 2800 | 58% | 100% |" in text


def test_optim_zero_report_compares_with_the_one_rank_update(tmp_path):
    def run(ranks, z0_update, z1_slowest, z0_step, z1_step):
        stages = {"ZeRO-0": {"update": z0_update, "update_slowest": z0_update, "step": z0_step, "state_mib": 74.4},
                  "ZeRO-1": {"update": z1_slowest * 0.9, "update_slowest": z1_slowest, "step": z1_step,
                             "state_mib": 74.4 / ranks}}
        (tmp_path / f"optim-zero-{ranks}ranks.json").write_text(
            json.dumps({"ranks": ranks, "num_parameters": 9753088, "rounds": 3, "stages": stages}))

    run(1, 40.0, 40.0, 600.0, 600.0)
    run(2, 42.0, 22.0, 700.0, 650.0)
    assert optim_cpu.zero_report_main([str(tmp_path)]) == 0
    text = (tmp_path / "optim-zero-scaling.md").read_text()
    assert "| 2 | 42.0 | 19.8 | 22.0 | 0.55 | 0.50 | 700.0 | 650.0 | 0.93 | 74.4 | 37.2 |" in text
    assert text.index("| 1 |") < text.index("| 2 |")
