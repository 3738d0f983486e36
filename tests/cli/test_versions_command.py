"""The CLI's side of versions and the run-folder lock: ``ortflow runs``, ``latest`` for export, evaluate and sample, and
``ortflow train`` refused while another process holds the folder."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import apply_overrides, config_from_dict, write_resolved_config
from ortflow.examples.mlp import build_mlp
from ortflow.versions import finish_version, plan_run

runner = CliRunner()


def _config_file(tmp_path, **versions):
    build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3)
    np.savez(tmp_path / "a.npz", features=np.zeros((8, 4), np.float32), labels=np.zeros(8, np.int64))
    raw = {"name": "v", "output_dir": str(tmp_path / "runs"), "model": {"path": str(tmp_path / "mlp.onnx")},
           "data": {"train": [str(tmp_path / "a.npz")]}, "train": {"batch_size": 2, "num_train_steps": 4},
           "versions": versions}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, config_from_dict(raw)


def test_runs_shows_a_run_without_versions_from_its_progress_and_export(tmp_path):
    # `ortflow run CONFIG` trains the output_dir itself (no version): `ortflow runs` said only "no versions yet"
    path, cfg = _config_file(tmp_path)
    cfg.output_dir.mkdir()
    (cfg.output_dir / "progress.json").write_text('{"step": 3, "total": 4, "final": false, "loss": 0.75, '
                                                  '"eval_loss": null, "lr": 0.001}')
    output = " ".join(runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "200"}).output.split())
    assert "no versions yet" in output and "the run folder itself: step 3/4, loss 0.75" in output, output
    (cfg.output_dir / "progress.json").write_text('{"step": 4, "total": 4, "final": true, "loss": 0.5, '
                                                  '"eval_loss": 0.25}')
    cfg.export_path.parent.mkdir(parents=True)
    cfg.export_path.write_bytes(b"onnx")
    output = " ".join(runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "200"}).output.split())
    assert f"step 4/4, loss 0.5, eval loss 0.25, model {cfg.export_path}" in output, output


def test_runs_lists_versions_with_status_parent_and_losses(tmp_path):
    path, cfg = _config_file(tmp_path, skip_unchanged=True)
    assert "no versions yet" in runner.invoke(app, ["runs", str(path)]).output
    first = plan_run(cfg, "fr-1", new_version=True, now=1)
    ckpt = first.config.checkpoints_dir / "step-00000004"  # a complete checkpoint to continue from
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"format": 1, "step": 4, "files": {}}')
    finish_version(cfg.output_dir, first.version, "completed", {"steps": "4/4", "final eval loss": 0.5})
    plan_run(cfg, "fr-2", new_version=True, now=2)  # unchanged: skipped
    second = plan_run(cfg.model_copy(update={"versions": cfg.versions.model_copy(update={"policy": "continue"})}),
                      "fr-3", new_version=True, now=3)  # a policy change: trained, continuing the first
    finish_version(cfg.output_dir, second.version, "completed", {
        "steps": "4/4", "final eval loss": 0.25, "best eval loss": 0.2,
        "exported model": str(cfg.output_dir / "versions" / second.version / "export" / "model.onnx")})
    result = runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    at = next(i for i, line in enumerate(lines) if line.startswith(first.version))
    assert "completed" in lines[at] and "4/4" in lines[at] and "eval 0.5 (best -)" in lines[at + 1]
    skipped = next(i for i, line in enumerate(lines) if "skipped" in line and not line.startswith(first.version))
    assert "skipped: config, model, data and policy unchanged" in " ".join(" ".join(lines[skipped:skipped + 3]).split())
    at = next(i for i, line in enumerate(lines) if line.startswith(second.version))
    detail = " ".join(" ".join(lines[at + 1:at + 4]).split())
    assert "continue" in lines[at] and f"parent {first.version}" in detail and "eval 0.25 (best 0.2)" in detail
    assert f"model versions/{second.version}/export/model.onnx" in detail  # relative to output_dir


def test_a_running_version_nobody_holds_shows_as_interrupted(tmp_path):
    path, cfg = _config_file(tmp_path)
    plan_run(cfg, "fr-1", new_version=True, now=1)  # its flow run died without recording an end
    result = runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "300"})
    assert "interrupted" in result.output


def test_export_evaluate_and_sample_of_latest_without_versions_say_what_to_do(tmp_path):
    latest = str(tmp_path / "runs" / "latest")
    for args in (["export", latest], ["evaluate", latest], ["sample", latest]):
        result = runner.invoke(app, args, terminal_width=250)
        assert result.exit_code == 1 and "no completed version" in result.output, result.output


HOLD = textwrap.dedent(
    """
    import sys, time
    from ortflow import runlock
    with runlock.hold(sys.argv[1], flow_run_id="fr-9", purpose="train"):
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_ortflow_train_is_refused_while_another_process_holds_the_folder(tmp_path):
    _, cfg = _config_file(tmp_path)
    write_resolved_config(cfg)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(cfg.output_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=300)
        assert result.exit_code == 1
        assert f"is in use by pid {holder.pid}" in result.output and "flow run fr-9" in result.output, result.output
        assert f"ortflow train {cfg.output_dir} --wait" in result.output  # the command that queues instead
        assert not cfg.checkpoints_dir.exists()
    finally:
        holder.kill()
        holder.wait()


def test_ortflow_train_submits_no_scheduler_job_for_a_finished_run(tmp_path, monkeypatch):
    """A Slurm job for a run whose final checkpoint exists would only wait in the queue for an allocation that trains
    nothing; ``ortflow train`` says the run is complete instead. A stop checkpoint before the end still submits."""
    from ortflow.checkpoints import CheckpointManager
    from ortflow.launch import slurm

    _, cfg = _config_file(tmp_path)
    cfg = apply_overrides(cfg, ["distributed.launcher=slurm", "distributed.num_ranks=2"])
    write_resolved_config(cfg)
    submitted = []
    monkeypatch.setattr(slurm, "submit", lambda *a, **k: submitted.append(a) or (_ for _ in ()).throw(
        slurm.LaunchError("sbatch: the test cluster is closed")))
    writer = lambda state, folder: (folder / "state.bin").write_bytes(state)  # noqa: E731
    ckpts = CheckpointManager(cfg.checkpoints_dir, 1, 10, is_writer=True, clock=lambda: 0.0, writer=writer)
    ckpts.save(3, b"three", {})
    result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=300)
    assert result.exit_code == 1 and "the test cluster is closed" in result.output and len(submitted) == 1
    ckpts.save(4, b"four", {})  # the final step: num_train_steps 4
    result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=300)
    assert result.exit_code == 0, result.output
    assert "training is already complete at step 4/4" in result.output and "no slurm job submitted" in result.output
    assert len(submitted) == 1


def test_ortflow_train_starts_no_ranks_for_a_finished_run(tmp_path, monkeypatch):
    """Launcher local: a run whose final checkpoint exists gets one line saying it is complete (and how to train
    further) and no mpiexec; a stop checkpoint before the end still launches the ranks, which resume."""
    from ortflow.checkpoints import CheckpointManager
    from ortflow.launch import local
    from ortflow.launch.job import LaunchResult

    _, cfg = _config_file(tmp_path)
    write_resolved_config(cfg)
    launched = []
    monkeypatch.setattr(local, "launch", lambda *a, **k: launched.append(a) or LaunchResult(0, ()))
    writer = lambda state, folder: (folder / "state.bin").write_bytes(state)  # noqa: E731
    ckpts = CheckpointManager(cfg.checkpoints_dir, 1, 10, is_writer=True, clock=lambda: 0.0, writer=writer)
    ckpts.save(3, b"three", {})
    result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=400)
    assert result.exit_code == 0 and "training finished" in result.output and len(launched) == 1, result.output
    ckpts.save(4, b"four", {})  # the final step: num_train_steps 4
    result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert len(launched) == 1 and "training finished" not in result.output and "layout:" not in result.output
    assert "training is already complete at step 4/4" in result.output and "no ranks started" in result.output
    assert (f"raise train.num_train_steps in {cfg.output_dir / 'config.yaml'} and run `ortflow train "
            f"{cfg.output_dir} --accept-changed-config`") in result.output, result.output
    (cfg.checkpoints_dir / "step-00000004" / "state.bin").write_bytes(b"fout")  # damaged: the ranks fall back
    result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=400)
    assert result.exit_code == 0 and "training finished" in result.output and len(launched) == 2, result.output


def test_ortflow_train_refuses_an_event_folder_that_takes_no_files_before_any_rank_starts(tmp_path, monkeypatch):
    """The checkpoint and TensorBoard folders get validate's check (a file written and removed) before the ranks
    start or a scheduler job is submitted: one error line naming the field."""
    from ortflow.launch import local, slurm

    _, cfg = _config_file(tmp_path)
    (tmp_path / "events").write_text("a file where the event folder goes")
    started = []
    monkeypatch.setattr(local, "launch", lambda *a, **k: started.append(a))
    monkeypatch.setattr(slurm, "submit", lambda *a, **k: started.append(a))
    for launcher in ("local", "slurm"):
        write_resolved_config(apply_overrides(cfg, [f"tensorboard.log_dir={tmp_path / 'events'}",
                                                    f"distributed.launcher={launcher}"]))
        result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=400)
        assert result.exit_code == 1, result.output
        assert (f"error: tensorboard.log_dir: {tmp_path / 'events'} is a file, not a folder; choose a folder path"
                in result.output), result.output
        assert not started and "layout:" not in result.output


def test_help_keeps_every_bracketed_shape_of_the_docstrings():
    import re

    import typer.main

    group = typer.main.get_command(app)
    checked = 0
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", {}) or {name: command}
        for sub_name, sub in subcommands.items():
            args = [name] if sub is command else [name, sub_name]
            wanted = re.findall(r"\\?\[[^\]\[]*\]", sub.help or "")
            if not wanted:
                continue
            shown = " ".join(runner.invoke(app, [*args, "--help"], terminal_width=400).output.split())
            for fragment in wanted:
                assert fragment.lstrip("\\") in shown, (args, fragment)
                checked += 1
    assert checked >= 4  # sample's four shapes at least


def test_run_summary_has_no_tokens_per_second_for_non_text_data():
    from ortflow.tasks.stages import summary_rows

    rows = {r["metric"]: r["value"] for r in summary_rows({"step": 4, "total": 4, "samples_per_s": 10.0}, {}, {})}
    assert "tokens/s" not in rows and rows["samples/s"] == 10.0
    text = summary_rows({"step": 4, "total": 4, "samples_per_s": 10.0, "tokens_per_s": 640.0}, {}, {})
    assert {"metric": "tokens/s", "value": 640.0} in text


def test_runs_shows_a_stopped_versions_steps_and_no_model_for_a_pruned_one(tmp_path):
    import json

    from ortflow.versions import prune_versions

    path, cfg = _config_file(tmp_path)
    plans = [plan_run(cfg, f"fr-{i}", new_version=True, now=i) for i in (1, 2, 3)]
    for plan, step in zip(plans, (4, 4, 3), strict=True):
        ckpt = plan.config.checkpoints_dir / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"format": 1, "step": step, "files": {}}))
        (plan.config.output_dir / "progress.json").write_text(json.dumps({"step": 2, "total": 4}))
    for plan in plans[:2]:
        finish_version(cfg.output_dir, plan.version, "completed", {
            "steps": "4/4", "exported model": str(plan.config.output_dir / "export" / "model.onnx")})
    stopped = finish_version(cfg.output_dir, plans[2].version, "stopped")  # by a signal, after step 3
    assert stopped["steps"] == "3/4"  # its newest (stop) checkpoint, not the last progress record
    assert prune_versions(cfg.output_dir, keep=1).deleted == (plans[0].version,)
    result = runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "300"})
    lines = result.output.splitlines()
    pruned = next(i for i, line in enumerate(lines) if line.startswith(plans[0].version))
    assert "pruned" in lines[pruned] and "model" not in lines[pruned + 1], lines[pruned:pruned + 2]
    kept = next(i for i, line in enumerate(lines) if line.startswith(plans[1].version))
    assert "model versions/" in lines[kept + 1]
    stop = next(line for line in lines if line.startswith(plans[2].version))
    assert "stopped" in stop and "steps 3/4" in stop, stop


def test_run_from_a_stage_of_a_version_says_it_reruns_that_version_not_a_new_one(tmp_path):
    path, cfg = _config_file(tmp_path)
    # An unknown policy stops the command right after its headline, before Prefect runs anything.
    for extra, headline in (([], f"ortflow run v: rerunning export onwards in the newest version of {cfg.output_dir}"),
                            (["--version", "20261130T041041Z-eaf1acce"],
                             "ortflow run v: rerunning export onwards in version 20261130T041041Z-eaf1acce of "
                             f"{cfg.output_dir}")):
        result = runner.invoke(app, ["run", str(path), "--new-version", "--from", "export", *extra, "--policy", "x"],
                               terminal_width=300)
        assert result.exit_code == 1, result.output
        assert result.output.splitlines()[:2] == [headline, "error: --policy x: use retrain or continue"], result.output
    result = runner.invoke(app, ["run", str(path), "--new-version", "--policy", "x"], terminal_width=300)
    assert result.output.splitlines()[0] == f"ortflow run v: a new version in {cfg.output_dir}", result.output
