"""No stage trusts a file it did not verify: a corrupted output is detected on rerun, a copied run folder never
replays the original's results, the exported model carries a checksum that export --verify and sample check, and
damaged artifacts are named before the engine loads them."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ortflow.checkpoints import list_complete
from ortflow.checkpoints.retention import retain_checkpoints
from ortflow.export import export_model
from ortflow.export.checksum import sidecar_path
from ortflow.tasks.caching import STAGES, outputs_intact, stage_key
from tests.faults import procs
from tests.support.runs import make_run, run_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.faults]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A trained, retained and exported 1-rank run."""
    root = tmp_path_factory.mktemp("cached")
    cfg = make_run(root, "run", distributed={"num_ranks": 1}, train={"num_train_steps": 10})
    out = run_ranks(cfg, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    retain_checkpoints(cfg)
    export_model(cfg.output_dir, cfg.export_path, config=cfg)
    return cfg


def _flip(path, at: int | None = None) -> bytes:
    original = path.read_bytes()
    data = bytearray(original)
    data[len(data) // 2 if at is None else at] ^= 0x10
    path.write_bytes(bytes(data))
    return original


def _targets(cfg) -> dict:
    newest = list_complete(cfg.checkpoints_dir)[-1].path
    return {
        "configure": cfg.artifacts_dir / "eval_model.onnx",
        "prepare_data": cfg.data_dir / "train-00000.arrow",
        "train": newest / "params.h5",
        "export": cfg.export_path,
    }


@pytest.mark.parametrize("stage", ["configure", "prepare_data", "train", "export"])
def test_a_corrupted_output_makes_its_stage_run_again(done, stage):
    assert outputs_intact(done, stage)
    path = _targets(done)[stage]
    original = _flip(path)
    try:
        assert not outputs_intact(done, stage), f"{path.name} corrupted, yet the {stage} cache is trusted"
    finally:
        path.write_bytes(original)
    assert outputs_intact(done, stage)


def test_a_copied_run_folder_runs_its_stages_instead_of_replaying_the_originals_results(done, tmp_path):
    # The copy holds the original's generation tokens and intact outputs; a key without the folder would hand it the
    # original's persisted results, whose paths (checkpoints, exported model) are the original's.
    keys = {stage: stage_key(done, stage) for stage in STAGES}  # the pipeline's run wrote the tokens
    copy = done.model_copy(update={"output_dir": tmp_path / "copy"})
    shutil.copytree(done.output_dir, copy.output_dir)
    for stage in STAGES:
        assert outputs_intact(copy, stage), stage
        assert stage_key(copy, stage) != keys[stage], f"the copy would replay the original's {stage} result"
        assert stage_key(done, stage) == keys[stage], f"{stage} is no longer cached in its own folder"


def _ortflow(*args: str) -> subprocess.CompletedProcess:
    """A process of its own: where a damaged file could reach the engine in the command's own process."""
    return subprocess.run([procs.ORTFLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_exported_model_has_a_sidecar_that_export_verify_checks(done):
    model = done.export_path
    assert sidecar_path(model).read_text().split()[1] == model.name
    ok = procs.ortflow_here("export", "--verify", str(model))  # checksum checks: in this process
    assert ok.returncode == 0 and "matches" in ok.stdout, ok.stdout
    original = _flip(model, at=len(model.read_bytes()) - 40)  # inside the weights: the model still loads
    try:
        bad = procs.ortflow_here("export", "--verify", str(model))
        assert bad.returncode == 1 and "does not match its checksum" in bad.stdout, bad.stdout
        sampled = procs.ortflow_here("sample", str(model), "--max-new-tokens", "1", "--prompt", "def ")
        assert sampled.returncode == 1 and "does not match its checksum" in sampled.stdout, sampled.stdout
        assert "def " not in sampled.stdout, sampled.stdout  # no prompt before the refusal, glued to its first line
        assert "Traceback" not in bad.stdout + sampled.stdout
    finally:
        model.write_bytes(original)


@pytest.mark.parametrize("name, how", [("training_model.onnx", "flip"), ("eval_model.onnx", "truncate")])
def test_damaged_artifacts_are_named_before_the_engine_loads_them(done, name, how):
    path = done.artifacts_dir / name
    original = path.read_bytes()
    if how == "flip":
        _flip(path)
    else:
        path.write_bytes(original[: len(original) // 3])
    final = list_complete(done.checkpoints_dir)[-1].path
    hidden = final.with_name(".final-set-aside")  # training left to do: a finished run starts no ranks
    try:
        final.rename(hidden)
        trained = procs.ortflow_here("train", str(done.output_dir), "--np", "1")  # the engine is in its rank
        hidden.rename(final)
        evaluated = _ortflow("evaluate", str(done.output_dir))
    finally:
        path.write_bytes(original)
        if hidden.exists():
            hidden.rename(final)
    for out in (trained, evaluated):
        assert out.returncode != 0 and name in out.stdout and "does not match its sha256" in out.stdout, out.stdout
        assert "Traceback" not in out.stdout, out.stdout
