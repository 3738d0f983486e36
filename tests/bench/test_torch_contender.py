"""The PyTorch contender on CPU with tiny shapes (needs torch: the bench extra; skipped without it)."""

from __future__ import annotations

import json

import pytest


def test_modes_are_built_once_and_timed_per_round(capsys, monkeypatch):
    pytest.importorskip("torch")
    from bench.torch_contender import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    main(["--device", "cpu", "--shape", "tiny", "--modes", "eager,fp32,fsdp2", "--rounds", "2", "--steps", "2",
          "--warmup", "1"])  # fmt: skip
    results = [json.loads(line[len("RESULT ") :]) for line in capsys.readouterr().out.splitlines()
               if line.startswith("RESULT ")]  # fmt: skip
    assert [(r["mode"], r["round"]) for r in results] == [("eager", 1), ("fp32", 1), ("eager", 2)]
    assert all(r["status"] == "ok" and r["step_time_s"] > 0 for r in results)
    assert results[0]["autocast_bf16"] and not results[1]["autocast_bf16"] and not results[1]["tf32"]
    assert results[2]["first_loss"] == results[0]["first_loss"]  # one model, kept across its windows


def test_a_failing_mode_is_reported_and_the_others_still_run(capsys, monkeypatch):
    pytest.importorskip("torch")
    from bench import torch_contender

    build = torch_contender.Bench.build

    def broken(self, mode, bucket_mb):
        if mode == "fp32":
            raise RuntimeError("no kernel for this mode")
        return build(self, mode, bucket_mb)

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(torch_contender.Bench, "build", broken)
    torch_contender.main(["--device", "cpu", "--shape", "tiny", "--modes", "fp32,eager", "--rounds", "2",
                          "--steps", "2", "--warmup", "1"])  # fmt: skip
    results = [json.loads(line[len("RESULT ") :]) for line in capsys.readouterr().out.splitlines()
               if line.startswith("RESULT ")]  # fmt: skip
    assert [(r["mode"], r["status"]) for r in results] == [("fp32", "failed"), ("eager", "ok"), ("eager", "ok")]
    assert "no kernel for this mode" in results[0]["error"]
