"""The Slurm launcher without a cluster: the sbatch script from the config, the state read from scontrol's answer,
and the config's refusals. The real cluster runs are in tests/prefect/test_slurm.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ortflow.config import ConfigError, config_from_dict
from ortflow.launch import slurm
from ortflow.launch.job import LaunchError, Phase, watch


def slurm_config(tmp_path: Path, num_ranks: int | str = 8, **section) -> object:
    return config_from_dict({
        "name": "mlp",
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model.onnx")},
        "data": {"train": [str(tmp_path / "data.npz")]},
        "train": {"batch_size": 4, "num_train_steps": 10},
        "distributed": {"num_ranks": num_ranks, "launcher": "slurm", "threads_per_rank": 2},
        "slurm": section,
    })


def test_the_script_asks_for_what_the_config_says(tmp_path):
    cfg = slurm_config(tmp_path, num_nodes=2, gpus_per_node=4, partition="gpu", time_limit="1-00:00:00",
                       account="ml-team", extra_sbatch=["--qos=high", "--constraint=a100"],
                       setup=["module load cuda/12.4"], stop_signal_s=300)  # fmt: skip
    script = slurm.render_script(cfg, cfg.output_dir, Path("/opt/venv/bin/mpiexec"), "mpich", "/opt/venv/bin/python")
    lines = script.splitlines()
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=2",
                     "#SBATCH --gpus-per-node=4", "#SBATCH --partition=gpu", "#SBATCH --time=1-00:00:00",
                     "#SBATCH --account=ml-team", "#SBATCH --qos=high", "#SBATCH --constraint=a100",
                     "#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                     f"#SBATCH --output={cfg.output_dir}/slurm/job-%j.out", "module load cuda/12.4"):
        assert expected in lines, expected
    start = next(line.strip() for line in lines if line.strip().startswith("setsid "))
    assert start.endswith(f"/opt/venv/bin/mpiexec -n 8 -prepend-rank /opt/venv/bin/python -u -P -m ortflow.trainer "
                          f"{cfg.output_dir} &")
    assert "unset ORTFLOW_LAUNCHER_PID ORTFLOW_LAUNCHER_HOST" in script  # the job outlives its submitter
    # Every #SBATCH line comes before the first command, or sbatch ignores it.
    first_command = next(i for i, line in enumerate(lines[1:], 1) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    # The time limit's signal stops the ranks; a clean stop (143) requeues the job instead of failing it.
    assert "trap 'limit=1;" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert script.index("trap 'limit=1;") < script.index("module load cuda/12.4")  # a signal during setup is caught


def test_srun_starts_the_ranks_with_the_sites_pmi_when_asked(tmp_path):
    cfg = slurm_config(tmp_path, num_nodes=2, launch="srun", srun_mpi="pmi2")
    script = slurm.render_script(cfg, cfg.output_dir, None, "srun", "/opt/venv/bin/python")
    start = next(line.strip() for line in script.splitlines() if line.strip().startswith("setsid "))
    assert start.startswith("setsid srun --mpi=pmi2 --kill-on-bad-exit=1 --ntasks=8 --label /opt/venv/bin/python -u")
    assert "mpiexec" not in script


def test_a_container_runner_starts_each_rank_in_the_image(tmp_path):
    cfg = slurm_config(tmp_path, launch="srun", python="/opt/ortflow/bin/python",
                       rank_prefix=["apptainer", "exec", "--bind", "/shared", "/shared/ortflow.sif"])
    script = slurm.render_script(cfg, cfg.output_dir, None, "srun", "/login/venv/bin/python")
    start = next(line.strip() for line in script.splitlines() if line.strip().startswith("setsid "))
    assert ("--label apptainer exec --bind /shared /shared/ortflow.sif /opt/ortflow/bin/python -u -P -m "
            f"ortflow.trainer {cfg.output_dir} &") in start


def test_the_script_leaves_out_what_the_config_does_not_set(tmp_path):
    cfg = slurm_config(tmp_path, requeue=False, stop_signal_s=0)
    script = slurm.render_script(cfg, cfg.output_dir, Path("/usr/bin/mpirun"), "openmpi")
    assert "#SBATCH --no-requeue" in script and "#SBATCH --signal" not in script
    assert "scontrol requeue" not in script
    assert not any(opt in script for opt in ("--partition", "--time", "--account", "--gpus-per-node"))
    assert "--tag-output" in script  # Open MPI's way of naming each line's rank


def test_the_config_refuses_what_a_slurm_job_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="num_ranks auto measures this host"):
        slurm_config(tmp_path, num_ranks="auto")
    with pytest.raises(ConfigError, match=r"num_ranks \(8\) must be a multiple of slurm.num_nodes \(3\)"):
        slurm_config(tmp_path, num_nodes=3)
    with pytest.raises(ConfigError, match="slurm.time_limit"):
        slurm_config(tmp_path, time_limit="two hours")
    with pytest.raises(ConfigError, match="slurm.extra_sbatch"):
        slurm_config(tmp_path, extra_sbatch=["--qos=high\nrm -rf /"])


def test_a_time_limit_in_minutes_may_be_written_as_a_yaml_number(tmp_path):
    """``time_limit: 30`` is Slurm's MINUTES form; YAML reads it as a number."""
    cfg = slurm_config(tmp_path, time_limit=30, stop_signal_s=60)
    assert cfg.slurm.time_limit == "30"
    assert "#SBATCH --time=30\n" in slurm.render_script(cfg, cfg.output_dir, Path("/opt/venv/bin/mpiexec"), "mpich")
    with pytest.raises(ConfigError, match="slurm.time_limit"):
        slurm_config(tmp_path, time_limit=-5)


@pytest.mark.parametrize(("time_limit", "stop_signal_s", "allowed"), [
    ("1", 180, False),  # the default signal 3 minutes before a 1-minute limit
    ("2", 90, False),  # 120 s - 90 s - 30 s of time-limit checks: nothing left to train
    ("2", 89, True), ("2:00", 89, True), ("1:30", 60, False), ("00:01:30", 60, False), ("1-00", 86400, False),
    ("1-0:1", 86400, True), ("1-0:0:1", 86400, False),
    ("1", 0, True),  # no early signal: nothing to refuse
    ("0", 180, True),  # --time=0: no time limit
])
def test_the_config_refuses_a_stop_signal_that_leaves_no_time_to_train(tmp_path, time_limit, stop_signal_s, allowed):
    """Slurm checks time limits every 30 s: an allocation trains at least time_limit - stop_signal_s - 30 s before
    the signal, so a signal that leaves no time at all would requeue the job again and again, training seconds (or
    nothing) in each allocation."""
    if allowed:
        slurm_config(tmp_path, time_limit=time_limit, stop_signal_s=stop_signal_s)
        return
    with pytest.raises(ConfigError, match=r"slurm.stop_signal_s \(\d+\) leaves no time to train in "
                       r"slurm.time_limit .*; lower stop_signal_s or raise time_limit"):
        slurm_config(tmp_path, time_limit=time_limit, stop_signal_s=stop_signal_s)


def test_relative_slurm_paths_resolve_against_the_configs_folder_wherever_it_is_rendered(tmp_path, monkeypatch):
    """The job runs in the run folder (--chdir), so slurm.python and slurm.mpiexec written relative to the config
    (``.venv/bin/python``) must reach the script as absolute paths; a bare command name stays one (the nodes' PATH)."""
    import yaml

    from ortflow.config import load_config

    project = tmp_path / "project"
    (project / "venv" / "bin").mkdir(parents=True)
    mpiexec = project / "venv" / "bin" / "mpiexec"
    mpiexec.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    mpiexec.chmod(0o755)
    raw = {"name": "mlp", "output_dir": "runs/mlp", "model": {"path": "model.onnx"}, "data": {"train": ["d.npz"]},
           "train": {"batch_size": 4, "num_train_steps": 10},
           "distributed": {"num_ranks": 2, "launcher": "slurm"},
           "slurm": {"python": "venv/bin/python", "mpiexec": "./venv/bin/mpiexec"}}
    (project / "run.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(project / "run.yaml")
    assert cfg.slurm.python == str(project / "venv" / "bin" / "python")
    assert Path(cfg.slurm.mpiexec) == mpiexec
    script = slurm.script_text(cfg, cfg.output_dir)
    assert f"setsid {mpiexec} -n 2 -prepend-rank {project}/venv/bin/python -u -P -m ortflow.trainer" in script
    bare = load_config(project / "run.yaml", ["slurm.python=python3"])
    assert bare.slurm.python == "python3"


def test_a_missing_slurm_mpiexec_names_the_config_field(tmp_path):
    cfg = slurm_config(tmp_path, num_ranks=2, mpiexec=str(tmp_path / "no" / "mpirun"))
    with pytest.raises(LaunchError, match=r"slurm.mpiexec .*no/mpirun.* not found") as raised:
        slurm.script_text(cfg, cfg.output_dir)
    assert "--mpiexec" not in str(raised.value)  # a local-launcher option, refused with launcher slurm
    problems = check(cfg, FakeCluster())  # `ortflow validate` and the flow's first task say the same, once
    assert problems[-1] == str(raised.value)


class FakeScontrol:
    """Answers ``scontrol show job -o ID`` from a list of states, as the controller would over a job's life."""

    def __init__(self, answers: list[str]):
        self.answers = answers
        self.commands: list[tuple[str, ...]] = []

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        self.commands.append(args)
        if args[0] == "scontrol":
            out = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            if out == "!timeout":
                raise subprocess.TimeoutExpired(args, 120)
            if out.startswith("!"):  # the controller does not answer: scontrol says why
                return subprocess.CompletedProcess(args, 1, "", out[1:])
            return subprocess.CompletedProcess(args, 0 if out else 1, out, "" if out else "Invalid job id specified")
        return subprocess.CompletedProcess(args, 0, "", "")


def job_with(tmp_path: Path, answers: list[str]) -> tuple[slurm.SlurmJob, FakeScontrol]:
    fake = FakeScontrol(answers)
    job = slurm.SlurmJob("42", tmp_path, {"scontrol": "scontrol", "scancel": "scancel"}, run=fake)
    (tmp_path / "slurm").mkdir(exist_ok=True)
    return job, fake


UNREACHABLE = "!slurm_load_jobs error: Unable to contact slurm controller (connect failure)"


def watch_with_clock(job: slurm.SlurmJob, lines: list[str]):
    now = [0.0]
    job.clock = lambda: now[0]
    return watch(job, lines.append, poll_s=5, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))


def test_a_controller_that_stops_answering_for_a_while_does_not_end_the_watch(tmp_path):
    """slurmctld restarting or too busy to answer: the job runs on, so the watch goes on, saying why it waits."""
    running = "JobId=42 JobState=RUNNING Reason=None ExitCode=0:0"
    job, fake = job_with(tmp_path, [running, UNREACHABLE, "!timeout", UNREACHABLE, running,
                                    "JobId=42 JobState=COMPLETED Reason=None ExitCode=0:0"])
    lines: list[str] = []
    result = watch_with_clock(job, lines)
    assert result.ok, result
    said = [line for line in lines if "does not answer" in line]
    assert said == ["ortflow: the Slurm controller does not answer (slurm_load_jobs error: Unable to contact slurm "
                    "controller (connect failure)): still watching slurm job 42"], lines
    assert "ortflow: the Slurm controller answers again: slurm job 42 is RUNNING" in lines
    assert not any(command[0] == "scancel" for command in fake.commands)


def test_a_controller_silent_past_the_grace_ends_the_watch_and_leaves_the_job_to_attach_to(tmp_path):
    job, fake = job_with(tmp_path, ["JobId=42 JobState=RUNNING Reason=None ExitCode=0:0", UNREACHABLE])
    lines: list[str] = []
    result = watch_with_clock(job, lines)
    assert result.returncode == 1 and result.retry, result
    assert f"has not answered for {slurm.CONTROLLER_GRACE_S:.0f} s" in result.detail
    assert f"ortflow train {tmp_path}" in result.detail  # attaches to the job once the controller answers
    assert not any(command[0] == "scancel" for command in fake.commands)  # nothing known: nothing cancelled


def test_a_requeued_job_is_watched_until_it_completes(tmp_path):
    job, _ = job_with(tmp_path, [
        "JobId=42 JobState=PENDING Reason=Resources ExitCode=0:0",
        "JobId=42 JobState=RUNNING Reason=None ExitCode=0:0",
        "JobId=42 JobState=PENDING Reason=BeginTime ExitCode=0:0",  # requeued: pending again under the same id
        "JobId=42 JobState=RUNNING Reason=None ExitCode=0:0",
        "JobId=42 JobState=COMPLETED Reason=None ExitCode=0:0",
    ])
    out = tmp_path / "slurm" / "job-42.out"
    out.write_text("ortflow: slurm job 42 attempt 0 on n1\n[0] step 1/2\n[0] step 2")  # the last line is incomplete
    lines: list[str] = []

    def sleep(_s: float) -> None:
        with out.open("a") as f:
            f.write("/2\n")

    result = watch(job, lines.append, sleep=sleep)
    assert result.returncode == 0 and result.job_id == "42" and result.launcher == "slurm"
    printed = [line for line in lines if "is pending" not in line]
    assert printed[:3] == ["ortflow: slurm job 42 attempt 0 on n1", "[0] step 1/2", "[0] step 2/2"]


@pytest.mark.parametrize(("answer", "code"), [
    ("JobId=42 JobState=FAILED Reason=NonZeroExitCode ExitCode=143:0", 143),
    ("JobId=42 JobState=CANCELLED Reason=None ExitCode=0:15", 143),
    ("JobId=42 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:0", 1),
])
def test_the_exit_status_comes_from_slurms_exit_code(tmp_path, answer, code):
    job, _ = job_with(tmp_path, [answer])
    state = job.poll()
    assert (state.phase, state.returncode) == (Phase.ENDED, code)


def test_a_job_slurm_no_longer_knows_reports_the_status_its_script_left(tmp_path):
    job, _ = job_with(tmp_path, [""])
    (tmp_path / "slurm" / "job-42.status").write_text("143\n")
    assert job.poll() == slurm.JobState(Phase.ENDED, "no longer known to Slurm (Invalid job id specified)", 143)


def test_cancel_signals_the_batch_shell_and_a_pending_job_is_just_removed(tmp_path):
    job, fake = job_with(tmp_path, ["JobId=42 JobState=RUNNING Reason=None ExitCode=0:0"])
    job.poll()
    job.cancel()
    assert fake.commands[-1] == ("scancel", "--batch", "--signal=TERM", "42")
    job, fake = job_with(tmp_path, ["JobId=42 JobState=PENDING Reason=Priority ExitCode=0:0"])
    job.poll()
    job.cancel()
    assert fake.commands[-1] == ("scancel", "42")


RUNNING = "JobId=42 JobState=RUNNING Reason=None ExitCode=0:0"
PENDING = "JobId=42 JobState=PENDING Reason=Priority ExitCode=0:0"
STOPPED = "JobId=42 JobState=CANCELLED Reason=None ExitCode=0:15"
TERM = ("scancel", "--batch", "--signal=TERM", "42")


@pytest.mark.parametrize(("answers", "said", "scancel"), [
    ([RUNNING], "SIGINT: asking the ranks of the slurm job 42 to stop after the current update", TERM),
    ([PENDING], "SIGINT: removing the pending slurm job 42 from the queue: no rank is running, nothing to checkpoint",
     ("scancel", "42")),
    ([UNREACHABLE, UNREACHABLE], "SIGINT: sending the stop signal to the slurm job 42: its state is unknown (the "
     "scheduler has not answered); ranks that run stop after the current update", TERM),
], ids=["running", "pending", "unanswered"])
def test_ctrl_c_before_the_first_poll_says_and_does_what_fits_the_state_slurm_reports(tmp_path, caplog, answers,
                                                                                       said, scancel):
    """A Ctrl-C that ``ortflow train`` took while it submitted the job (before the watch's first ``scontrol``): the
    line names what happens to the job as Slurm reports it, and the job gets exactly that (a running job's ranks a
    stop signal for their stop checkpoint, a pending job removed); a job whose state the controller never said (no
    answer to the stop's ``scontrol`` nor to the cancel's) gets the stop signal, and the line says so."""
    import signal

    job, fake = job_with(tmp_path, [*answers, STOPPED])
    with caplog.at_level("WARNING", logger="ortflow.launch.job"):
        result = watch(job, lambda line: None, sleep=lambda s: None, forward_signals=True, received=[signal.SIGINT])
    assert [r.getMessage() for r in caplog.records] == [said]
    assert [c for c in fake.commands if c[0] == "scancel"] == [scancel]
    assert result.signal == signal.SIGINT


def test_ctrl_c_during_the_first_poll_asks_a_running_jobs_ranks_to_stop_and_says_so(tmp_path, caplog):
    """KeyboardInterrupt inside the watch's first ``scontrol`` (no state seen yet): the job is polled again, and its
    running ranks are asked to stop, as the line says, not killed as a pending job would be removed."""
    job, fake = job_with(tmp_path, [RUNNING, STOPPED])
    calls = []

    def interrupted_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return fake(*args)

    job._run = interrupted_once
    with caplog.at_level("WARNING", logger="ortflow.launch.job"), pytest.raises(KeyboardInterrupt):
        watch(job, lambda line: None, sleep=lambda s: None, grace_s=30)
    assert [r.getMessage() for r in caplog.records] == [
        "asking the ranks of the slurm job 42 to stop after the current update (30 s grace)"]
    assert [c for c in fake.commands if c[0] == "scancel"] == [TERM]


def test_ortflow_train_refuses_local_options_and_incomplete_sections_with_a_scheduler(tmp_path):
    from typer.testing import CliRunner

    from ortflow.cli import app
    from tests.support.runs import make_run

    cfg = make_run(tmp_path, "cli", distributed={"num_ranks": 2})
    runner = CliRunner()
    refused = runner.invoke(app, ["train", str(cfg.output_dir), "--launcher", "slurm", "--np", "2"])
    assert refused.exit_code == 1 and "--mpiexec are for launcher local" in refused.output
    no_image = runner.invoke(app, ["train", str(cfg.output_dir), "--launcher", "kubernetes"])
    assert no_image.exit_code == 1 and "needs kubernetes.image" in no_image.output
    assert "Traceback" not in refused.output + no_image.output


def test_an_outside_scancel_ends_the_run_without_a_retry_and_says_so(tmp_path):
    job, _ = job_with(tmp_path, ["JobId=42 JobState=CANCELLED Reason=None ExitCode=0:15"])
    result = watch(job, lambda line: None, sleep=lambda s: None)
    assert not result.ok and not result.retry
    assert "cancelled outside ortflow (scancel)" in result.summary() and "not submitted again" in result.summary()
    ours, _ = job_with(tmp_path, ["JobId=42 JobState=RUNNING Reason=None ExitCode=0:0",
                                  "JobId=42 JobState=CANCELLED Reason=None ExitCode=0:15"])
    ours.poll()
    ours.cancel()  # this watcher's own cancel: the ordinary stopped state
    state = ours.poll()
    assert state.detail == "CANCELLED" and state.retry


def test_a_job_that_can_never_start_is_cancelled_and_fails_with_its_reason(tmp_path):
    job, fake = job_with(tmp_path, ["JobId=42 JobState=PENDING Reason=PartitionConfig ExitCode=0:0"])
    result = watch(job, lambda line: None, sleep=lambda s: None)
    assert not result.ok and not result.retry
    assert "can never start (PENDING, Reason=PartitionConfig)" in result.summary()
    assert ("scancel", "42") in fake.commands


def test_a_pending_jobs_reason_is_shown_every_minute(tmp_path):
    job, _ = job_with(tmp_path, ["JobId=42 JobState=PENDING Reason=Resources ExitCode=0:0"] * 40 +
                      ["JobId=42 JobState=COMPLETED Reason=None ExitCode=0:0"])
    now = [0.0]
    lines: list[str] = []
    watch(job, lines.append, poll_s=5, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    said = [line for line in lines if "is pending" in line]
    assert said == ["ortflow: slurm job 42 is pending: PENDING (Resources)"] * 4  # at 0, 60, 120 and 180 s


def test_a_job_whose_state_slurm_has_not_said_is_not_reported_pending(tmp_path):
    """Before the controller's first answer the job's state is unknown, not pending: the pending line comes once
    Slurm says PENDING, with its reason."""
    job, _ = job_with(tmp_path, [UNREACHABLE, UNREACHABLE, "JobId=42 JobState=PENDING Reason=Resources ExitCode=0:0",
                                 "JobId=42 JobState=RUNNING Reason=None ExitCode=0:0",
                                 "JobId=42 JobState=COMPLETED Reason=None ExitCode=0:0"])
    lines: list[str] = []
    assert watch_with_clock(job, lines).ok
    said = [line for line in lines if "is pending" in line or "answer" in line]
    assert said == ["ortflow: the Slurm controller does not answer (slurm_load_jobs error: Unable to contact slurm "
                    "controller (connect failure)): still watching slurm job 42",
                    "ortflow: the Slurm controller answers again: slurm job 42 is PENDING",
                    "ortflow: slurm job 42 is pending: PENDING (Resources)"], lines


def test_the_failure_summary_quotes_the_current_attempt_only(tmp_path):
    job, _ = job_with(tmp_path, ["JobId=42 JobState=RUNNING Reason=None ExitCode=0:0",
                                 "JobId=42 JobState=FAILED Reason=NonZeroExitCode ExitCode=1:0"])
    (tmp_path / "slurm" / "job-42.out").write_text(
        "ortflow: slurm job 42 attempt 0 on n1\n[0] ERROR: node n1 lost\n"
        "ortflow: slurm job 42 attempt 1 on n2\n[1] ERROR: out of memory\n")
    result = watch(job, lambda line: None, sleep=lambda s: None)
    assert result.error_lines == ("[1] ERROR: out of memory",)
    assert "node n1 lost" not in result.summary()


class FakeCluster:
    """sinfo and sbatch --test-only of a cluster with one partition of two 2-CPU nodes."""

    def __init__(self, test_only: tuple[int, str] = (0, "sbatch: Job 3 to start at now"), down: str | None = None):
        self.test_only = test_only
        self.down = down  # what every command says when the controller does not answer
        self.commands: list[tuple[str, ...]] = []

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        self.commands.append(args)
        if self.down is not None:
            if self.down == "timeout":
                raise subprocess.TimeoutExpired(args, 60)
            return subprocess.CompletedProcess(args, 1, "", self.down)
        if args[:3] == ("sinfo", "-h", "-o"):
            return subprocess.CompletedProcess(args, 0, "debug*\n", "")
        if args[:3] == ("sinfo", "-h", "-N"):
            return subprocess.CompletedProcess(args, 0, "node1 2\nnode2 2\n", "")
        code, said = self.test_only
        return subprocess.CompletedProcess(args, code, "", said)


def check(cfg, cluster: FakeCluster) -> list[str]:
    from ortflow.launch.slurm_check import request_problems

    return request_problems(cfg, run=cluster, which=lambda name: f"/usr/bin/{name}")


def test_the_request_is_checked_against_the_cluster(tmp_path):
    assert check(slurm_config(tmp_path, num_ranks=2, num_nodes=2), FakeCluster()) == []
    unknown = check(slurm_config(tmp_path, num_ranks=2, partition="gpu"), FakeCluster())
    assert unknown == ["slurm.partition 'gpu' does not exist on this cluster (partitions: debug): name one of them"]
    too_big = check(slurm_config(tmp_path, num_ranks=8, num_nodes=2), FakeCluster())  # 4 ranks x 2 CPUs per node
    assert "2 node(s) with 8 CPUs each" in too_big[0] and "node1=2, node2=2" in too_big[0]
    invalid = FakeCluster((1, "sbatch: error: Invalid account"))
    refused = check(slurm_config(tmp_path, num_ranks=2, num_nodes=2), invalid)
    assert refused == ["sbatch --test-only refuses the run's job (Invalid account): change the slurm section or "
                       "distributed.num_ranks (`ortflow render` prints the script)"]


@pytest.mark.parametrize("said", [
    "slurm_load_partitions: Unable to contact slurm controller (connect failure)\n",
    "sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
    "sinfo: fatal: Could not establish a configuration source\n",
    "timeout",  # a slurm.conf that cannot be read: the commands retry for a minute
])
def test_a_cluster_that_does_not_answer_is_named_as_such_not_as_a_bad_request(tmp_path, said):
    problems = check(slurm_config(tmp_path, num_ranks=2, num_nodes=2), FakeCluster(down=said))
    assert len(problems) == 1, problems
    assert problems[0].startswith("the Slurm controller does not answer (sinfo: "), problems
    assert "SLURM_CONF" in problems[0] and "change the slurm section" not in problems[0]


FAKE_RANKS = """#!/bin/bash
trap 'echo "ranks: stop checkpoint written"; exit 143' TERM
touch "$STARTED"
while :; do sleep 0.05; done
"""


def run_script(tmp_path: Path, signal_name: str, setup: list[str] | None = None,
               requeue: bool = True) -> tuple[int, str]:
    """Run the job script with bash as Slurm would (fake ranks and a fake scontrol), send it ``signal_name`` once the
    ranks run (or, with a setup that waits for $RELEASED, during the setup, which then ends), and return its exit
    status and output."""
    import os
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ranks").write_text(FAKE_RANKS)
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    cfg = slurm_config(tmp_path, setup=setup or [], requeue=requeue)
    (cfg.output_dir / "slurm").mkdir(parents=True)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render_script(cfg, cfg.output_dir, bin_dir / "ranks", "mpich", "python"))
    started = tmp_path / ("setup-started" if setup else "started")
    released = tmp_path / "released"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "STARTED": str(started),
           "RELEASED": str(released)}  # fmt: skip
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(getattr(signal, signal_name))
    released.touch()  # bash runs the trap before the command after the one the signal interrupted
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out + ((tmp_path / "scontrol.log").read_text() if (tmp_path / "scontrol.log").exists()
                                   else "")  # fmt: skip


def test_the_time_limit_signal_stops_the_ranks_and_requeues_the_job(tmp_path):
    code, out = run_script(tmp_path, "SIGUSR1")
    assert "ranks: stop checkpoint written" in out and "requeue 42" in out
    assert "stopped at the time limit (status 143): requeued; the next allocation resumes" in out
    assert code == 0  # a requeue, not a failure


def test_scancel_stops_the_ranks_without_a_requeue(tmp_path):
    code, out = run_script(tmp_path, "SIGTERM")
    assert "ranks: stop checkpoint written" in out and "requeue" not in out and code == 143


def test_the_time_limit_signal_during_the_setup_keeps_the_ranks_from_starting(tmp_path):
    code, out = run_script(tmp_path, "SIGUSR1", setup=['touch "$STARTED"',
                                                        'while [ ! -e "$RELEASED" ]; do sleep 0.05; done'])
    assert not (tmp_path / "started").exists() and "requeue 42" in out and code == 0


def test_without_requeue_the_time_limit_stop_ends_the_job_and_says_how_to_resume(tmp_path):
    code, out = run_script(tmp_path, "SIGUSR1", requeue=False)
    assert "slurm.requeue is off: resume with ortflow train" in out and "requeue 42" not in out and code == 143
