"""Retention: the pure policy shared by trainer and retention stage, the trainer's on-disk retention, and the stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ortflow.checkpoints import CHECKPOINT_FILE, CheckpointInfo, CheckpointManager, retention_to_delete
from ortflow.checkpoints.retention import INDEX_NAME, export_choice, plan_retention, retain_checkpoints
from ortflow.config import config_from_dict


def fake_writer(state: bytes, folder: Path) -> None:
    (folder / CHECKPOINT_FILE).write_bytes(state)


def infos(losses: dict[int, float | None]) -> list[CheckpointInfo]:
    return [CheckpointInfo(Path(f"step-{s:08d}"), s, {"eval_loss": loss}) for s, loss in losses.items()]


# -- the pure policy ---------------------------------------------------------------------------------------------------


def test_keeps_the_newest_n_and_deletes_the_rest_in_order():
    assert retention_to_delete([30, 10, 50, 20, 40], keep_newest=2) == [10, 20, 30]


def test_fewer_checkpoints_than_n_deletes_nothing():
    assert retention_to_delete([1, 2], keep_newest=3) == []
    assert retention_to_delete([], keep_newest=3) == []


def test_protected_steps_survive_whatever_their_age():
    assert retention_to_delete([1, 2, 3, 4, 5], keep_newest=2, protect={1, 3}) == [2]
    assert retention_to_delete([1, 2, 3], keep_newest=0) == [1, 2, 3]
    assert retention_to_delete([1, 2, 3], keep_newest=0, protect=[2]) == [1, 3]


def test_duplicates_count_once_and_negative_n_is_refused():
    assert retention_to_delete([5, 5, 4, 3], keep_newest=2) == [3]
    with pytest.raises(ValueError, match="keep_newest"):
        retention_to_delete([1], keep_newest=-1)


def test_stage_plan_keeps_newest_best_and_final_with_reasons():
    checkpoints = infos({10: 0.9, 20: 0.3, 30: 0.5, 40: 0.7, 50: 0.8})
    kept, deleted = plan_retention(checkpoints, keep_newest=2)
    assert deleted == [10, 30]
    assert kept == {
        20: ["best_eval_loss", "export_source"],
        40: ["newest"],
        50: ["newest", "final"],
    }


def test_export_choice_is_best_else_newest_and_later_wins_ties():
    assert export_choice(infos({1: 0.5, 2: 0.2, 3: 0.9})).step == 2
    assert export_choice(infos({1: 0.2, 2: 0.2, 3: 0.9})).step == 2
    assert export_choice(infos({1: None, 2: None, 3: None})).step == 3
    assert export_choice([]) is None
    kept, deleted = plan_retention(infos({1: None, 2: None, 3: None}), keep_newest=1)
    assert deleted == [1, 2] and kept == {3: ["newest", "final", "export_source"]}


# -- on disk -----------------------------------------------------------------------------------------------------------


def test_trainer_keeps_exactly_n_newest_complete_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, period=2, max_num_checkpoints=3, is_writer=True, writer=fake_writer)
    (tmp_path / "step-00000001").mkdir()  # incomplete: neither counted nor deleted by retention
    kept_after = []
    for step in range(1, 15):
        mgr.maybe_save(step, b"s%d" % step, {})
        kept_after.append(sorted(p.name for p in tmp_path.glob("step-*") if (p / "meta.json").exists()))
    assert kept_after[1] == ["step-00000002"]  # fewer than N exist: nothing deleted
    assert kept_after[3] == ["step-00000002", "step-00000004"]
    assert kept_after[-1] == ["step-00000010", "step-00000012", "step-00000014"]
    assert (tmp_path / "step-00000001").exists()


def _cfg(tmp_path: Path, keep: int):
    return config_from_dict({
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model.onnx")},
        "data": {"train": [str(tmp_path / "train.npz")]},
        "train": {"batch_size": 4, "num_train_steps": 10},
        "checkpoint": {"max_num_checkpoints": keep},
    })


def test_retention_stage_keeps_newest_best_final_and_writes_the_index(tmp_path):
    cfg = _cfg(tmp_path, keep=2)
    mgr = CheckpointManager(cfg.checkpoints_dir, 1, 100, is_writer=True, writer=fake_writer)
    losses = {1: 0.9, 2: 0.2, 3: 0.6, 4: 0.5, 5: 0.7, 6: None}
    for step, loss in losses.items():
        mgr.save(step, b"state-%d" % step, {"eval_loss": loss})
    # A damaged checkpoint (truncated) takes no part and is left for a person to look at.
    with open(cfg.checkpoints_dir / "step-00000003" / CHECKPOINT_FILE, "r+b") as f:
        f.truncate(2)

    index = retain_checkpoints(cfg, clock=lambda: 0.0)
    on_disk = sorted(int(p.name[5:]) for p in cfg.checkpoints_dir.glob("step-*"))
    assert on_disk == [2, 3, 5, 6]
    assert [k["step"] for k in index.kept] == [2, 5, 6]
    assert {k["step"]: k["reasons"] for k in index.kept}[2] == ["best_eval_loss", "export_source"]
    assert [d["step"] for d in index.deleted] == [1, 4]
    assert [d["step"] for d in index.damaged] == [3] and "truncated" in index.damaged[0]["error"]
    assert (index.best_step, index.final_step, index.export_step) == (2, 6, 2)
    written = json.loads((cfg.output_dir / INDEX_NAME).read_text())
    assert written["kept"] == index.kept and written["created"] == "1970-01-01T00:00:00Z"
    assert not list(cfg.output_dir.glob(".*tmp*"))

    again = retain_checkpoints(cfg)  # idempotent: nothing more to delete
    assert again.deleted == [] and [k["step"] for k in again.kept] == [2, 5, 6]


def test_retention_stage_on_empty_run_writes_an_empty_index(tmp_path):
    index = retain_checkpoints(_cfg(tmp_path, keep=2))
    assert index.kept == [] and index.export_step is None
    assert json.loads(index.path.read_text())["kept"] == []


def test_the_run_summary_says_which_newest_instead_of_calling_every_kept_one_newest():
    from ortflow.tasks.stages import summary_rows

    index = {"keep_newest": 3, "kept": [{"step": 40, "reasons": ["newest"]},
                                        {"step": 60, "reasons": ["newest", "best_eval_loss", "final"]}]}  # fmt: skip
    rows = {r["metric"]: r["value"] for r in summary_rows({}, index, {})}
    assert rows["kept checkpoints"] == ("step 40 (one of the 3 newest), "
                                        "step 60 (one of the 3 newest, best eval loss, final)")  # fmt: skip
