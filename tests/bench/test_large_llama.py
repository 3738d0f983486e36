"""The CPU-checkable parts of the 1B Llama GPU bench (bench/large_llama.py, bench/torch_llama.py)."""

from __future__ import annotations

import json

import pytest

from bench import large_llama
from ortflow.config import config_from_dict


def test_each_precision_trains_zero_1_on_nccl_with_the_shared_workload(tmp_path):
    args = large_llama.parse(["configure", str(tmp_path), "bf16", "--gpus", "2", "--batch", "4", "--seq", "256"])
    raw = large_llama.run_config(tmp_path, "bf16", args)
    cfg = config_from_dict(raw)  # the schema accepts it as written
    assert cfg.distributed.zero_stage == 1 and cfg.distributed.use_nccl and cfg.distributed.num_ranks == 2
    assert cfg.precision.use_mixed_precision and cfg.precision.use_bfloat16
    assert cfg.train.batch_size == 4 and cfg.model.path == tmp_path / "llama.onnx"
    fp16 = config_from_dict(large_llama.run_config(tmp_path, "fp16", args))
    assert fp16.precision.use_mixed_precision and not fp16.precision.use_bfloat16


def test_split_layouts_train_the_same_sequences_per_update_in_stages_or_tensor_parallel_pieces(tmp_path):
    base = ["--gpus", "2", "--batch", "8", "--seq", "512"]
    dp = config_from_dict(large_llama.run_config(tmp_path, "fp16", large_llama.parse(["configure", str(tmp_path),
                                                                                       "fp16", *base])))
    pp = config_from_dict(large_llama.run_config(tmp_path, "fp16", large_llama.parse(["configure", str(tmp_path),
                                                                                       "fp16", "--layout", "pp",
                                                                                       *base])))
    tp = config_from_dict(large_llama.run_config(tmp_path, "bf16", large_llama.parse(["configure", str(tmp_path),
                                                                                       "bf16", "--layout", "tp",
                                                                                       *base])))
    assert dp.train.global_batch_size == pp.train.global_batch_size == tp.train.global_batch_size == 16
    assert dp.distributed.zero_stage == 1 and dp.output_dir == tmp_path / "run-fp16"
    assert pp.distributed.pipeline_parallel_size == 2 and pp.distributed.zero_stage == 0
    assert pp.train.batch_size * large_llama.PIPELINE_MICRO_BATCHES == 16  # 8 micro-batches per update
    assert pp.output_dir == tmp_path / "run-fp16-pp" and pp.precision.use_mixed_precision
    assert tp.distributed.horizontal_parallel_size == 2 and tp.output_dir == tmp_path / "run-bf16-tp"
    assert tp.precision.use_bfloat16


def test_a_recompute_contender_is_its_split_layout_with_recompute_forward_in_a_folder_of_its_own(tmp_path):
    base = ["--gpus", "2", "--batch", "8", "--seq", "512"]
    for layout, name in (("pp", "ortflow fp16 2 pipeline stages"), ("tp", "ortflow fp16 tensor parallel 2")):
        kept = large_llama.parse(["configure", str(tmp_path), "fp16", "--layout", layout, *base])
        recompute = large_llama.parse(["configure", str(tmp_path), "fp16", "--layout", layout, "--recompute", *base])
        a = config_from_dict(large_llama.run_config(tmp_path, "fp16", kept))
        b = config_from_dict(large_llama.run_config(tmp_path, "fp16", recompute))
        assert not a.distributed.recompute_forward and b.distributed.recompute_forward
        assert a.output_dir == tmp_path / f"run-fp16-{layout}"
        assert b.output_dir == tmp_path / f"run-fp16-{layout}-recompute"
        assert a.model_dump(exclude={"name", "output_dir", "distributed"}) == b.model_dump(
            exclude={"name", "output_dir", "distributed"})  # the same workload, precision and model
        assert (a.distributed.pipeline_parallel_size, a.distributed.horizontal_parallel_size) == (
            b.distributed.pipeline_parallel_size, b.distributed.horizontal_parallel_size)
        assert large_llama.contender(kept) == name and large_llama.contender(recompute) == name + " (recompute)"
    with pytest.raises(SystemExit):  # data parallelism has no forward to recompute
        large_llama.parse(["configure", str(tmp_path), "fp16", "--recompute", *base])


def test_the_step_time_is_the_median_window_after_the_warm_up():
    windows = [{"forward_backward": 9.0, "update": 1.0}, {"forward_backward": 0.5, "update": 0.1},  # updates 0-3
               {"forward_backward": 0.3, "update": 0.1}, {"forward_backward": 0.4, "update": 0.2},
               {"forward_backward": 0.2, "update": 0.2}]  # fmt: skip
    assert large_llama.step_time({"windows": windows}, display=2, warmup=4) == pytest.approx(0.2)  # 0.2, 0.3, 0.2 s
    assert large_llama.step_time({"windows": windows[:2]}, display=2, warmup=4) is None


def test_mfu_is_six_flops_per_parameter_and_token_against_the_gpus_peak():
    assert large_llama.mfu(100_000, 1_100_000_000, 2, 989.0) == pytest.approx(6 * 1.1e9 * 1e5 / (2 * 989e12))
    assert large_llama.mfu(None, 1_100_000_000, 2, 989.0) is None


def test_the_report_reads_every_contender_from_the_logs_and_renders_tokens_and_mfu(tmp_path):
    rows = [{"contender": "ortflow fp16 ZeRO-1", "gpus": 2, "step_time_s": 0.25, "tokens_per_s": 32768.0,
             "first_loss": 10.4, "last_loss": 9.1, "status": "ok"},
            {"contender": "PyTorch FSDP2 + compile bf16", "status": "failed", "error": "CUDA out of memory"}]
    (tmp_path / "2-train-fp16.log").write_text("noise\nRESULT " + json.dumps(rows[0]) + "\n")
    (tmp_path / "3-torch.log").write_text("RESULT " + json.dumps(rows[1]) + "\n")
    found = large_llama.read_results(tmp_path)
    assert found == rows
    text = large_llama.render(found, {"parameters": 1_123_117_056, "gpus": 2, "batch": 8, "seq": 512,
                                      "peak_tflops": 989.0, "commit": "abc123"})
    util = 6 * 1_123_117_056 * 32768 / (2 * 989e12)
    assert f"| ortflow fp16 ZeRO-1 | ok | 250.0 | 32,768 | {util:.1%} | 10.4 | 9.1 |" in text
    assert "| PyTorch FSDP2 + compile bf16 | failed | - | - | - |" in text and "CUDA out of memory" in text
    assert "\nCommit abc123." in text and "1.12B parameters" in text


def test_the_torch_contender_trains_the_same_shape_on_cpu(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    from bench import torch_llama

    summary = tmp_path / "model.log"
    summary.write_text(json.dumps({"shape": {"d_model": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 48,
                                             "vocab": 64}}) + "\n")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    torch_llama.main(["--summary", str(summary), "--device", "cpu", "--no-compile", "--no-transformers",
                      "--gpus", "1", "--batch", "2", "--seq", "8", "--steps", "3", "--warmup", "1"])
    record = json.loads(capsys.readouterr().out.split("RESULT ", 1)[1])
    assert record["status"] == "ok", record
    assert record["tokens_per_s"] == pytest.approx(2 * 8 / record["step_time_s"])


def test_the_bench_configures_a_llama_through_the_cli_as_its_gpu_run_does(tmp_path):
    from tools.make_large_llama import PRESETS, write_model

    write_model(tmp_path / "llama.onnx", PRESETS["tiny"])
    large_llama.main(["configure", str(tmp_path), "fp16", "--gpus", "2", "--batch", "2", "--seq", "16", "--steps",
                      "2", "--vocab", "512"])
    record = json.loads((tmp_path / "run-fp16" / "configure.json").read_text())
    assert record["num_parameters"] == PRESETS["tiny"].num_parameters()
    import onnx

    training = onnx.load(str(tmp_path / "run-fp16" / "artifacts" / "training_model.onnx"), load_external_data=False)
    assert "loss_scale" in {i.name for i in training.graph.input}  # fp16: the loss-scale input of mixed precision
    assert (tmp_path / "run-fp16" / "data").is_dir()


def test_the_recompute_contender_configures_on_its_layouts_artifacts_as_hard_links(tmp_path):
    from tools.make_large_llama import PRESETS, write_model

    write_model(tmp_path / "llama.onnx", PRESETS["tiny"])
    work = ["fp16", "--layout", "pp", "--gpus", "2", "--batch", "2", "--seq", "16", "--steps", "2", "--vocab", "512"]
    large_llama.main(["configure", str(tmp_path), *work])
    large_llama.main(["configure", str(tmp_path), *work, "--recompute"])
    kept, recompute = tmp_path / "run-fp16-pp", tmp_path / "run-fp16-pp-recompute"
    import yaml

    assert yaml.safe_load((recompute / "config.yaml").read_text())["distributed"]["recompute_forward"] is True
    assert yaml.safe_load((kept / "config.yaml").read_text())["distributed"]["recompute_forward"] is False
    record = json.loads((recompute / "configure.json").read_text())
    assert record["artifacts_dir"] == str(recompute / "artifacts")  # configure verified and recorded the new place
    originals = sorted(p for p in (kept / "artifacts").rglob("*") if p.is_file())
    assert originals
    for original in originals:  # every artifact file shared, none built again
        assert (recompute / original.relative_to(kept)).stat().st_ino == original.stat().st_ino, original


def test_the_report_command_writes_markdown_and_json_with_the_run_facts(tmp_path):
    row = {"contender": "ortflow bf16 ZeRO-1", "gpus": 2, "step_time_s": 0.5, "tokens_per_s": 16384.0,
           "status": "ok"}
    (tmp_path / "2-train-bf16.log").write_text("RESULT " + json.dumps(row) + "\n")
    large_llama.main(["report", str(tmp_path), "--size", "1b", "--command", "bash bench/large_llama.sh"])
    saved = json.loads((tmp_path / "large-llama.json").read_text())
    assert saved["results"] == [row] and saved["meta"]["parameters"] == 1_123_117_056
    assert saved["meta"]["commit"] and saved["meta"]["command"] == "bash bench/large_llama.sh"
    assert "| ortflow bf16 ZeRO-1 | ok | 500.0 | 16,384 |" in (tmp_path / "large-llama.md").read_text()
