"""Every file a stage reads from a run folder is verified first: configure.json (itself sealed) vouches for the
artifacts and cannot be deleted or truncated to switch the checks off; config.yaml is checked against the record its
writer left (an edit needs ``--accept-changed-config``, which refuses one the artifacts or the model's fixed batch dim
cannot take); ``ortflow evaluate`` checks the shards as training does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ortflow.config import RESOLVED_CONFIG_NAME, load_yaml
from tests.faults import procs
from tests.support.fixed_batch_mlp import build_fixed_batch_classifier
from tests.support.runs import copied_run, make_run

pytestmark = [pytest.mark.mpi, pytest.mark.faults]


# What a command says and its status are checked: the commands run in this process (procs.ortflow_here).
_ortflow = procs.ortflow_here
SECTIONS = {"distributed": {"num_ranks": 1}, "train": {"num_train_steps": 4}}


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("configured"), "run", **SECTIONS)


@pytest.fixture
def run(configured, tmp_path):
    """A run folder of its own for each test, with the configured artifacts copied (configure verifies and reuses
    them)."""
    return copied_run(configured, make_run, tmp_path, "run", **SECTIONS)


def _refused(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode != 0, out.stdout[-3000:]
    assert "Traceback" not in out.stdout, out.stdout[-3000:]
    for word in words:
        assert word in out.stdout, (word, out.stdout[-3000:])


@pytest.mark.parametrize("damage", ["deleted", "truncated", "flipped"])
def test_a_damaged_configure_json_stops_train_evaluate_export_and_prepare_data(run, damage):
    record = run.output_dir / "configure.json"
    text = record.read_text()
    if damage == "deleted":
        record.unlink()
    elif damage == "truncated":
        record.write_text(text[: len(text) // 2])
    else:  # one digit of a recorded value changed: still valid JSON
        info = json.loads(text)
        info["num_parameters"] += 1
        record.write_text(json.dumps(info, indent=2))
    for args in (["train", str(run.output_dir)], ["evaluate", str(run.output_dir), "--checkpoint", "initial"],
                 ["export", str(run.output_dir), "--checkpoint", "initial"],
                 ["prepare-data", str(run.output_dir / RESOLVED_CONFIG_NAME), "--set", "data.rows_per_shard=64"]):
        out = _ortflow(*args)
        _refused(out, "configure.json", "ortflow configure")
    assert not run.export_path.exists()


def test_a_flipped_artifact_with_a_truncated_configure_json_is_refused_not_trained(run):
    record = run.output_dir / "configure.json"
    record.write_text(record.read_text()[:200])
    state = run.artifacts_dir / "checkpoint"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    _refused(_ortflow("train", str(run.output_dir)), "configure.json")
    assert not any(run.checkpoints_dir.glob("step-*"))


def test_an_edited_config_yaml_is_refused_until_accepted(run):
    path = run.output_dir / RESOLVED_CONFIG_NAME
    raw = load_yaml(path.read_text())
    raw["optimizer"]["learning_rate"] = 0.5
    path.write_text(json.dumps(raw))  # JSON is YAML: the same config with another learning rate
    out = _ortflow("train", str(run.output_dir))
    _refused(out, "config.yaml", "--accept-changed-config", "ortflow configure")
    # A rank started by hand (`python -m ortflow.trainer`, as a cluster script would) refuses it the same way.
    rank = subprocess.run([sys.executable, "-m", "ortflow.trainer", str(run.output_dir)], capture_output=True,
                          text=True, timeout=120)
    _refused(subprocess.CompletedProcess(rank.args, rank.returncode, rank.stdout + rank.stderr),
             "config.yaml", "ortflow configure")
    assert not any(run.checkpoints_dir.glob("step-*"))
    out = _ortflow("train", str(run.output_dir), "--accept-changed-config")
    assert out.returncode == 0, out.stdout[-3000:]
    assert any(run.checkpoints_dir.glob("step-*"))


def test_a_rank_piped_to_a_reader_passes_on_its_refusal_before_it_exits(run):
    # The refusal is the rank's last output before exit 1; its output relays (ortflow/trainer/output.py) hold each
    # chunk half a second between reading it and queuing it (slow_relay_rank.py), as a reader thread waiting for the
    # interpreter's lock does for a moment: the exit drain must count those bytes too, or the message is lost.
    path = run.output_dir / RESOLVED_CONFIG_NAME
    raw = load_yaml(path.read_text())
    raw["optimizer"]["learning_rate"] = 0.5
    path.write_text(json.dumps(raw))
    rank = subprocess.run([sys.executable, str(Path(__file__).with_name("slow_relay_rank.py")), str(run.output_dir)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)  # `... | tee`
    assert rank.returncode == 1, rank.stdout[-3000:]
    _refused(rank, "config.yaml", "ortflow configure")


def test_an_accepted_edit_may_not_change_the_artifacts(run):
    path = run.output_dir / RESOLVED_CONFIG_NAME
    raw = load_yaml(path.read_text())
    raw["model"]["loss"] = "mse" if raw["model"].get("loss") != "mse" else "cross_entropy"
    path.write_text(json.dumps(raw))
    _refused(_ortflow("train", str(run.output_dir), "--accept-changed-config"), "ortflow configure")


def test_an_accepted_edit_may_not_give_a_fixed_batch_model_another_batch_size(tmp_path):
    # Without the check the edit was recorded and every rank failed in the engine's first update with a traceback.
    model = build_fixed_batch_classifier(tmp_path / "fixed.onnx", batch=4)
    cfg = make_run(tmp_path, "fixed", model=model, data={"columns": {"x": "features"}}, **SECTIONS)
    path = cfg.output_dir / RESOLVED_CONFIG_NAME
    raw = load_yaml(path.read_text())
    raw["train"]["batch_size"] = 2
    path.write_text(json.dumps(raw))
    _refused(_ortflow("train", str(cfg.output_dir), "--accept-changed-config"), "train.batch_size 2",
             "fixed batch dim of 4")
    assert not any(cfg.checkpoints_dir.glob("step-*"))


def test_a_truncated_config_yaml_is_refused_not_read_with_defaults(run):
    path = run.output_dir / RESOLVED_CONFIG_NAME
    text = path.read_text()
    path.write_text(text[: text.index("optimizer:")])  # the later sections would silently fall back to defaults
    for args in (["train", str(run.output_dir)], ["evaluate", str(run.output_dir), "--checkpoint", "initial"]):
        _refused(_ortflow(*args), "config.yaml", "ortflow configure")


def test_evaluate_refuses_a_corrupted_eval_shard(run):
    shard = next(run.data_dir.glob("eval-*.arrow"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the feature values: the file still reads, with another loss
    shard.write_bytes(bytes(data))
    _refused(_ortflow("evaluate", str(run.output_dir), "--checkpoint", "initial"), shard.name, "prepare-data")
