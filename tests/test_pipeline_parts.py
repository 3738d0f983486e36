"""The pipeline's small parts, without a server: which failures are retried, rank line levels, the progress
artifact's final words, stage options from the config, the loss-curve data, overrides, the shipped examples, and the
configure stage's cache key on a folder configured since by hand."""

from __future__ import annotations

import errno
import logging

import numpy as np
import pytest

from ortflow.config import ConfigError, apply_overrides, config_from_dict, find_problems
from ortflow.runlock import RunFolderLocked
from ortflow.tasks.charts import chart_markdown, loss_curve
from ortflow.tasks.policy import will_repeat
from ortflow.tasks.runs import stage_options
from ortflow.tasks.training import RankLineLevels, TrainingFailed, failure_repeats, final_description
from ortflow.trainer.metrics import TensorBoardLog


def _cfg(tmp_path, **sections):
    raw = {"output_dir": str(tmp_path), "model": {"path": str(tmp_path / "m.onnx")}, "data": {"train": ["x.npz"]},
           "train": {"batch_size": 2, "num_train_steps": 4}, **sections}
    return config_from_dict(raw)


@pytest.mark.parametrize(("err", "repeats"), [
    (ValueError("bad shape"), True),
    (RunFolderLocked.__new__(RunFolderLocked), True),
    (OSError(errno.EACCES, "Permission denied"), True),
    (FileNotFoundError(errno.ENOENT, "No such file"), True),
    (IsADirectoryError(errno.EISDIR, "Is a directory"), True),
    (OSError(errno.EIO, "I/O error"), False),
    (ConnectionResetError(errno.ECONNRESET, "reset"), False),
    (RuntimeError("rank 1 was killed"), False),
    (TrainingFailed("exit 1", will_repeat=True), True),
    (TrainingFailed("exit 137"), False),
])
def test_only_failures_that_would_not_repeat_are_retried(err, repeats):
    assert will_repeat(err) is repeats


def test_failed_jobs_are_classified_by_the_ranks_error_lines():
    assert failure_repeats(("[0] ValueError: data.columns names no column 'x'",))
    # ortflow's own refusals in a rank (trainer/__main__.py) are one line naming the fix, with no exception name
    assert failure_repeats(("[0] 03:51:14 ERROR rank 0 refused: /r/checkpoints/step-00000100 belongs to run 'a'; "
                            "stopping every rank",))
    assert not failure_repeats(("[1] 03:12:05 ERROR rank 1 failed; stopping every rank",))
    assert failure_repeats(("[1] onnxruntime...: [ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions",))
    assert not failure_repeats(("[1] BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "killed by signal 9"))
    assert failure_repeats(("[0] ERROR weight update 7: non-finite loss",), returncode=4)  # a divergence repeats
    assert failure_repeats(("[1] 22:06:48 ERROR rank 1 ran out of GPU memory (CUBLAS_STATUS_ALLOC_FAILED): the "
                            "model's weights ... do not fit; use a smaller micro-batch",))  # the same config repeats
    from ortflow.tasks.training import EXIT_NONFINITE as task_view
    from ortflow.trainer.__main__ import EXIT_NONFINITE
    assert task_view == EXIT_NONFINITE


def test_rank_lines_keep_their_level_and_tracebacks_are_errors():
    levels = RankLineLevels()
    lines = [
        ("[0] 03:12:04 INFO step 10/20 | loss 1.0", logging.INFO),
        ("[1] 03:12:04 WARNING SIGTERM received: stopping after the current weight update", logging.WARNING),
        ("[1] 03:12:05 ERROR rank 1 failed; stopping every rank", logging.ERROR),
        ("[1] Traceback (most recent call last):", logging.ERROR),
        ('[1]   File "loop.py", line 3', logging.ERROR),
        ("[0] some stray stdout line", logging.INFO),
    ]
    assert [levels(line) for line, _ in lines] == [level for _, level in lines]


def test_progress_artifact_ends_with_the_final_state_not_an_eta():
    record = {"step": 8, "total": 20, "loss": 0.5, "eta_s": 34}
    assert final_description(record, None).startswith("Completed: step 8/20")
    assert "ETA" not in final_description(record, TrainingFailed("training failed with exit status 137:\n[1] x"))
    assert final_description(record, TrainingFailed("training failed with exit status 137:\n[1] x")) == (
        "Failed at step 8/20: training failed with exit status 137:")
    assert final_description(record, KeyboardInterrupt()).startswith("Stopped by a signal at step 8/20")
    from prefect._internal.concurrency.cancellation import CancelledError

    assert final_description(record, CancelledError()).startswith("Cancelled at step 8/20")
    timed_out = final_description(record, CancelledError(), timed_out=True)
    assert timed_out.startswith("Timed out at step 8/20") and "Cancelled" not in timed_out
    # The ranks stop after their current update, past the last progress record: a stop names its checkpoint's step.
    assert final_description(record, KeyboardInterrupt(), checkpoint_step=9).startswith("Stopped by a signal at step "
                                                                                       "9/20")
    assert final_description(record, TrainingFailed("boom"), checkpoint_step=5) == "Failed at step 8/20: boom"


def test_retries_and_timeouts_come_from_the_config_with_todays_defaults(tmp_path):
    default = _cfg(tmp_path)
    assert {k: v for k, v in stage_options(default, "export").items() if k != "retry_condition_fn"} == {
        "retries": 2, "retry_delay_seconds": [2.0, 10.0], "timeout_seconds": None}
    assert stage_options(default, "train")["retry_delay_seconds"] == [5.0, 30.0]
    custom = _cfg(tmp_path, pipeline={"train_retries": 3, "train_retry_delays_s": [1], "train_timeout_s": 60})
    options = stage_options(custom, "train")
    assert (options["retries"], options["retry_delay_seconds"], options["timeout_seconds"]) == (3, [1, 1, 1], 60)


def test_loss_curve_holds_the_logged_losses_and_a_resume_overrides_a_repeated_step(tmp_path):
    first = TensorBoardLog(tmp_path, ("train/loss", "eval/loss"), ())
    for step, loss in [(1, 1.5), (2, 1.25), (3, 1.0)]:
        first.scalars(step, {"train/loss": loss, "eval/loss": loss + 0.5 if step == 2 else None})
    first.close()
    resumed = TensorBoardLog(tmp_path, ("train/loss", "eval/loss"), ())  # a retry resumes from step 2
    resumed.scalars(3, {"train/loss": 0.875})
    resumed.scalars(4, {"train/loss": 0.75, "eval/loss": 1.0})
    resumed.close()
    curve = loss_curve(tmp_path)
    assert curve == {"train": [(1, 1.5), (2, 1.25), (3, 0.875), (4, 0.75)], "eval": [(2, 1.75), (4, 1.0)]}
    text = chart_markdown("demo", curve)
    assert "data:image/svg+xml;base64," in text and "| 3 | 0.875 |  |" in text and "| 4 | 0.75 | 1 |" in text
    assert "No losses" in chart_markdown("demo", loss_curve(tmp_path / "none"))


def test_a_resumed_tensorboard_log_holds_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardLog(tmp_path, ("train/loss",), ())
    for step in range(1, 8):  # the run stops after step 7; its newest checkpoint is step 5
        first.scalars(step, {"train/loss": float(step)})
    first.close()
    resumed = TensorBoardLog(tmp_path, ("train/loss",), (), resumed_from=5)
    for step in range(6, 10):
        resumed.scalars(step, {"train/loss": step + 0.5})
    resumed.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == list(range(1, 10)), steps  # every step once, in order
    assert [e.value for e in events.Scalars("train/loss")][4:6] == [5.0, 6.5]


def test_overrides_apply_to_one_config_and_are_validated(tmp_path):
    cfg = _cfg(tmp_path)
    changed = apply_overrides(cfg, ["train.num_train_steps=8", "versions.policy=continue"])
    assert (changed.train.num_train_steps, changed.versions.policy) == (8, "continue")
    assert cfg.train.num_train_steps == 4  # the original is untouched
    with pytest.raises(ConfigError, match="train.num_train_steps"):
        apply_overrides(cfg, ["train.num_train_steps=-1"])


def test_an_empty_data_entry_from_an_unset_environment_variable_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unset environment variable"):
        _cfg(tmp_path, data={"train": [""]})


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_examples_from_the_installed_package_are_valid_configs(tmp_path, kind):
    from ortflow.examples.write import write_example

    config = write_example(kind, tmp_path / kind)
    cfg, problems = find_problems(config)
    assert problems == [] and cfg.model.path == tmp_path / kind / "model.onnx"
    if kind == "mlp":
        data = np.load(tmp_path / "mlp" / "data" / "train.npz")
        assert data["features"].shape == (2048, 8) and set(np.unique(data["labels"])) <= {0, 1, 2}
    else:
        assert cfg.data.train[0].endswith("*.py")


def test_artifact_keys_differ_between_output_dirs_sharing_a_name_and_versions_share_their_base_folders(tmp_path):
    from types import SimpleNamespace

    from ortflow.tasks.policy import artifact_key

    one = SimpleNamespace(name="Demo Run", output_dir=tmp_path / "a")
    two = SimpleNamespace(name="Demo Run", output_dir=tmp_path / "b")
    version = SimpleNamespace(name="Demo Run", output_dir=tmp_path / "a" / "versions" / "20261126T000000Z-1234abcd")
    assert artifact_key(one, "summary") != artifact_key(two, "summary")
    assert artifact_key(version, "summary") == artifact_key(one, "summary")
    assert artifact_key(one, "summary").startswith("ortflow-demo-run-") and artifact_key(one, "x").endswith("-x")


def test_the_loss_chart_has_axes_ticks_tick_labels_and_axis_titles():
    import xml.etree.ElementTree as ET

    from ortflow.tasks.charts import _svg

    svg = ET.fromstring(_svg({"train": [(1, 2.5), (50, 1.0), (100, 0.25)], "eval": [(50, 1.2), (100, 0.5)]}))
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in svg.iter(f"{ns}text")]
    assert {"step", "loss", "train loss", "eval loss"} <= set(texts)
    assert {"1", "100", "2.5", "0.25"} <= set(texts)  # the ends of both axes are labelled
    assert len([t for t in texts if t.replace(".", "").isdigit()]) >= 8  # ticks along both axes
    assert len(list(svg.iter(f"{ns}polyline"))) == 2


def test_a_flow_run_process_counts_as_vanished_only_on_its_own_host_once_its_pid_is_gone_or_reused():
    import os
    import socket
    import subprocess

    from ortflow.tasks.liveness import (
        HOST_LABEL,
        PID_LABEL,
        PIDS_LABEL,
        START_LABEL,
        pid_namespace,
        process_start,
        vanished,
    )

    host = socket.gethostname()
    me = {HOST_LABEL: host, PIDS_LABEL: pid_namespace(), PID_LABEL: str(os.getpid()),
          START_LABEL: process_start(os.getpid())}
    assert not vanished(me, host)
    assert vanished({**me, START_LABEL: "1"}, host)  # the pid now names another process
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert vanished({**me, PID_LABEL: str(gone.pid)}, host)
    assert not vanished({**me, PID_LABEL: str(gone.pid)}, "another-host")  # nothing to know about its processes
    assert not vanished({**me, PID_LABEL: str(gone.pid), PIDS_LABEL: "x:1"}, host)  # a container of the same name
    assert not vanished({}, host)  # a run that recorded no process


def test_a_busy_server_does_not_hold_up_a_flow_run_at_its_process_labels_which_go_to_the_runs_server(
    monkeypatch, caplog
):
    import os
    import threading
    import types

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ortflow.tasks import liveness

    sent, release = [], threading.Event()

    def slow_server(flow_run, labels):  # a server answering "database is locked" while the client backs off
        release.wait(30)
        sent.append((flow_run.id, labels, PREFECT_API_URL.value()))

    monkeypatch.setattr(liveness, "_send_labels", slow_server)
    monkeypatch.setattr(liveness, "LABEL_WAIT_S", 0.2)
    run = types.SimpleNamespace(id="run-1", name="busy-run")
    # The run's server is given per context (as ortflow run's temporary server is): the labels' thread uses it too.
    with caplog.at_level("WARNING"), temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        liveness.record_process(None, run, None)  # returns after LABEL_WAIT_S, the labels still on their way
    assert not sent and "has not taken flow run busy-run's process labels" in caplog.text
    release.set()
    for thread in threading.enumerate():
        if thread.name == "ortflow-labels":
            thread.join(10)
    assert sent and sent[0][1][liveness.PID_LABEL] == str(os.getpid())  # they follow
    assert sent[0][2] == "http://127.0.0.1:9/api"  # to the run's server, not to a server Prefect would start


def test_a_never_prepared_data_folder_is_not_reported_as_untrusted(tmp_path, caplog):
    from ortflow.tasks.caching import outputs_intact

    cfg = _cfg(tmp_path)
    with caplog.at_level("WARNING"):
        assert not outputs_intact(cfg, "prepare_data")
    assert "prepare the data first" not in caplog.text and "not trusted" not in caplog.text


def test_the_configure_stage_is_not_replayed_on_a_folder_configured_since_for_another_config(tmp_path):
    # `ortflow configure` by hand between two flow runs of one config, with another model, precision or layout: the
    # folder's artifacts are no longer this config's, so the flow's configure stage runs (and builds them again)
    # instead of replaying its result; once it has, the folder is back in the state the cached result describes.
    from ortflow.configure.configure import configure
    from ortflow.tasks.caching import stage_key
    from tests.support.runs import make_run

    cfg = make_run(tmp_path, "run", num_rows=64, distributed={"num_ranks": 1})
    key = stage_key(cfg, "configure")
    split = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(
        update={"num_ranks": 2, "pipeline_parallel_size": 2})})
    configure(split)  # the folder holds no checkpoint: the other layout is built
    assert stage_key(cfg, "configure") != key
    assert not configure(cfg).reused
    assert stage_key(cfg, "configure") == key
