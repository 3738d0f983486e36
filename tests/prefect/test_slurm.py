"""distributed.launcher slurm against a real Slurm cluster of two nodes on this host (munged, slurmctld and two
slurmd started here as root) and a real local Prefect server: a flow's 2-rank job trains to the end, ``prefect
flow-run cancel`` leaves a stop checkpoint and no job, a requeued job resumes to the same bits as an uninterrupted
run, SIGTERM to ``ortflow train`` cancels its job, a run longer than its time limit completes over several
allocations of one job with no failed attempt, an outside ``scancel`` stops the run without a resubmission, and a
request the cluster could never start is refused before configure."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ortflow.checkpoints import list_complete
from ortflow.launch.job import read_record
from ortflow.trainer.metrics import read_progress
from tests.faults.procs import ortflow_here
from tests.launch.slurm_cluster import slurm_cluster, unavailable
from tests.prefect.serving import read_flow_run, serving
from tests.support.prefect_runs import final_parameters, mlp_config, wait_for, write_config

#: Why this machine cannot run the test cluster (None: it can); checked before any fixture starts a Prefect server.
UNAVAILABLE = unavailable()
# Every test takes time_limited, so its run starts with the module's first test (it mostly waits for Slurm's
# time-limit checks) and trains beside the others' jobs until the last test asserts on it.
pytestmark = [pytest.mark.prefect, pytest.mark.slurm,
              pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)),
              pytest.mark.usefixtures("time_limited")]

ORTFLOW = str(Path(sys.executable).parent / "ortflow")
#: One rank on each of the test cluster's two nodes.
TWO_NODES = {"num_nodes": 2}
#: The test that asserts on the time-limit run; :func:`time_limited` starts that run only where it is selected.
TIME_LIMIT_TEST = "test_a_run_longer_than_its_time_limit_completes_across_allocations_with_no_failed_attempt"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running test cluster; the Slurm commands of this process and its children find it through SLURM_CONF.

    Its two nodes have two CPUs each: a 2-rank job (one rank on each node) takes one CPU of each, so the time-limit
    run (:func:`time_limited`) trains beside the job of the test that runs meanwhile."""
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)  # munged refuses a key folder others can write to
    with slurm_cluster(root, cpus=2) as env:
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = env["SLURM_CONF"]  # sbatch/scontrol/scancel run by the in-process flow
        try:
            yield env
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    found = re.search(r"JobState=(\S+)", out.stdout)
    return found[1] if found else ""


def in_queue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True)
    return bool(out.stdout.strip())


def send(pids: list[int], sig: int) -> None:
    """Signal each of the processes that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def job_output(run_dir: Path, job_id: str) -> str:
    return (run_dir / "slurm" / f"job-{job_id}.out").read_text()


LIMIT_LINE = "ortflow: the time limit is near"
#: Rank 0 says where the ranks stopped.
STOP_LINE = re.compile(r"\[0\] .* ranks stopped together after step (\d+)")
REQUEUED_LINE = "requeued; the next allocation resumes"
#: The time-limit run's updates, and how many of them each allocation trains before its ranks wait for the signal.
LIMITED_STEPS, LIMITED_SHARE = 300, 50


@pytest.fixture(scope="module")
def time_limited(request, slurm, mlp_sources, tmp_path_factory):
    """The run of :data:`TIME_LIMIT_TEST`, longer than its time limit: started with the module's first test and driven
    in a thread (:func:`drive_time_limited`) while the other tests run; yields the run's config and a future of
    ``(job id, output of ortflow train)``. Where that test is not selected, nothing starts (None). A run still going
    when the module ends is stopped: its driver fails, its job is cancelled."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    if not any(getattr(item, "originalname", None) == TIME_LIMIT_TEST for item in request.session.items):
        yield None
        return
    tmp_path = tmp_path_factory.mktemp("limited")
    # Slurm checks time limits every 30 s and sends the --signal up to 30 s early: with a 2-minute limit and the
    # signal 80 s before it, an allocation gets it 10-40 s after it starts, and its limit comes 80 s or more after
    # that, whatever the load: time for the ranks to stop with a checkpoint and the job to requeue itself. (A
    # requeued allocation starts about 6 s after the check that signalled the last one, so it gets its signal at the
    # check 24 s later: the run takes about a minute, which the other tests' jobs fill.)
    cfg = mlp_config(tmp_path, mlp_sources, "limited", distributed={"launcher": "slurm"},
                     slurm={**TWO_NODES, "time_limit": "2", "stop_signal_s": 80},
                     train={"num_train_steps": LIMITED_STEPS, "display_loss_steps": 1, "evaluation_period": 0},
                     checkpoint={"period": 0, "max_num_checkpoints": 2})  # fmt: skip
    prepared(cfg, tmp_path, "limited")
    ended = threading.Event()
    with ThreadPoolExecutor(1, thread_name_prefix="time-limited") as pool:
        future = pool.submit(drive_time_limited, cfg, tmp_path / "limited.log", ended)
        try:
            yield cfg, future
        finally:
            ended.set()  # a driver still waiting gives up, stops its `ortflow train` and cancels its job


def drive_time_limited(cfg, log_file: Path, ended) -> tuple[str, str]:
    """``ortflow train`` on the time-limit run to its end, pausing each allocation's ranks once they have trained
    their share until Slurm's time-limit signal comes; returns the job id and what ``ortflow train`` printed. Gives
    up (fails) once ``ended`` is set."""
    import signal
    import time

    from tests.support.prefect_runs import processes_mentioning

    run_dir = cfg.output_dir
    deadline = time.monotonic() + 500  # the whole run, within pytest's timeout
    ranks = lambda: processes_mentioning(f"-m ortflow.trainer {run_dir}")  # noqa: E731
    out_file = lambda: run_dir / "slurm" / f"job-{job_id}.out"  # noqa: E731
    text = lambda: out_file().read_text() if out_file().exists() else ""  # noqa: E731
    seen = lambda line: len(line.findall(text())) if isinstance(line, re.Pattern) else text().count(line)  # noqa: E731
    step = lambda: (read_progress(run_dir) or {}).get("step", 0)  # noqa: E731

    def until(condition, what: str, interval: float = 0.2):
        value = wait_for(lambda: ended.is_set() or condition(), max(1.0, deadline - time.monotonic()), what,
                         interval)  # fmt: skip
        if ended.is_set():
            raise AssertionError(f"the module's tests ended while the time-limit run waited for {what}")
        return value

    job_id = None
    with log_file.open("w") as log:
        proc = subprocess.Popen([ORTFLOW, "train", str(run_dir), "--launcher", "slurm"], stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        paused: list[int] = []
        try:
            job_id = until(lambda: (read_record(run_dir) or {}).get("job_id"), "the job id")
            # Stand in for a machine too slow to finish in two allocations, whatever this one's speed: each
            # allocation's ranks pause once they have trained their share, until Slurm's time-limit signal comes.
            # An allocation whose signal comes before its ranks trained (or started) just adds one more.
            while seen(STOP_LINE) < 2:
                limits, target = seen(LIMIT_LINE), step() + LIMITED_SHARE
                until(lambda n=limits, t=target: seen(LIMIT_LINE) > n or step() >= t,
                      f"the allocation to train to step {target} or reach its time limit", interval=0.01)
                if seen(LIMIT_LINE) == limits:
                    paused = ranks()
                    send(paused, signal.SIGSTOP)
                until(lambda n=limits: seen(LIMIT_LINE) > n, "the time-limit signal")
                send(paused, signal.SIGCONT)  # the stop signal waits for them: they stop with a checkpoint
                paused = []
                until(lambda n=limits: seen(REQUEUED_LINE) > n, "the job to requeue itself")
                if seen(STOP_LINE) >= 2:  # the last allocation gets the time the rest needs (as an admin would
                    # give it), so this machine's speed cannot make the run need more allocations
                    raised = subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=15"],
                                            capture_output=True, text=True, timeout=60)  # fmt: skip
                    assert raised.returncode == 0, raised.stderr
            until(lambda: proc.poll() is not None, "ortflow train to exit")
            assert proc.returncode == 0, log_file.read_text()[-3000:]
        finally:
            send(paused, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                subprocess.run(["scancel", str(job_id)], check=False)
    return job_id, log_file.read_text()


# The tests that need no Prefect server come first, so the time-limit run starts before the server does.


def test_a_requeued_job_resumes_bit_identical_to_an_uninterrupted_run(slurm, mlp_sources, tmp_path):
    import signal

    from tests.support.prefect_runs import rank_pids
    from tests.support.runs import start_ranks

    steps = 300
    sections = {"train": {"num_train_steps": steps, "display_loss_steps": 50, "evaluation_period": 0},
                "checkpoint": {"period": 50, "max_num_checkpoints": 2}}  # fmt: skip
    runs = {name: mlp_config(tmp_path, mlp_sources, name, distributed={"launcher": "slurm"}, slurm=TWO_NODES,
                             **sections) for name in ("plain", "requeued")}  # fmt: skip
    for name, cfg in runs.items():
        prepared(cfg, tmp_path, name)

    # The uninterrupted reference runs here meanwhile (the same 2 ranks x 1 thread, mpiexec without Slurm).
    plain = start_ranks(runs["plain"], timeout=300)
    cfg = runs["requeued"]
    out_file = lambda: cfg.output_dir / "slurm" / f"job-{job_id}.out"  # noqa: E731
    job_id, paused = None, []
    with (tmp_path / "requeued.log").open("w") as log:
        proc = subprocess.Popen([ORTFLOW, "train", str(cfg.output_dir), "--launcher", "slurm"], stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:
            job_id = wait_for(lambda: (read_record(cfg.output_dir) or {}).get("job_id"), 120, "the job id")
            wait_for(lambda: list_complete(cfg.checkpoints_dir), 300, "the first checkpoint", interval=0.01)
            # The ranks wait (paused) for the requeue, however far this machine's speed would have taken them.
            paused = rank_pids(cfg.output_dir)
            send(paused, signal.SIGSTOP)
            requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
            assert requeue.returncode == 0, requeue.stderr
            wait_for(lambda: "ortflow: SIGTERM" in out_file().read_text(), 120, "Slurm to stop the job's script")
            send(paused, signal.SIGCONT)
            paused = []
            # Slurm holds the requeued job back for cred_expire (5 s on the test cluster), then starts it again.
            assert proc.wait(timeout=300) == 0, (tmp_path / "requeued.log").read_text()[-3000:]
        finally:
            send(paused, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                subprocess.run(["scancel", str(job_id)], check=False)
            reference = plain.result()
    assert reference.returncode == 0, reference.stdout[-3000:]
    output = job_output(cfg.output_dir, job_id)
    assert f"slurm job {job_id} attempt 1" in output, output[-3000:]  # the same job id ran a second time
    resumed = re.findall(r"rank 0/2 .* starting from (.*)", output)
    assert resumed[0] == "the initial weights" and resumed[-1].startswith("step "), resumed
    assert read_progress(cfg.output_dir)["step"] == steps
    ours, theirs = final_parameters(cfg), final_parameters(runs["plain"])
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert np.array_equal(ours[name], theirs[name]), name


def test_sigterm_to_ortflow_train_cancels_the_slurm_job_with_a_stop_checkpoint(slurm, mlp_sources, tmp_path):
    import signal

    cfg = mlp_config(tmp_path, mlp_sources, "cli-stopped", distributed={"launcher": "slurm"}, slurm=TWO_NODES,
                     train={"num_train_steps": 200000, "display_loss_steps": 50, "evaluation_period": 0},
                     checkpoint={"period": 100000, "max_num_checkpoints": 1})
    prepared(cfg, tmp_path, "cli")
    with (tmp_path / "cli.log").open("w") as log:
        proc = subprocess.Popen([ORTFLOW, "train", str(cfg.output_dir)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: (read_progress(cfg.output_dir) or {}).get("step", 0) >= 20, 240, "the job to train")
            job_id = read_record(cfg.output_dir)["job_id"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=180) == 143, (tmp_path / "cli.log").read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    printed = (tmp_path / "cli.log").read_text()
    assert "training stopped" in printed and f"slurm job {job_id}" in printed
    stopped = re.search(r"stop requested: ranks stopped together after step (\d+)", job_output(cfg.output_dir, job_id))
    assert stopped and list_complete(cfg.checkpoints_dir)[-1].step == int(stopped[1])
    assert not in_queue(job_id)


def test_srun_with_the_sites_pmi2_starts_the_ranks_of_a_job_that_trains_to_completion(slurm, mlp_sources, tmp_path):
    cfg = mlp_config(tmp_path, mlp_sources, "srun", distributed={"launcher": "slurm"},
                     slurm={**TWO_NODES, "launch": "srun", "srun_mpi": "pmi2"})
    prepared(cfg, tmp_path, "srun")
    done = ortflow_here("train", str(cfg.output_dir))  # the command in this process; its job as usual
    assert done.returncode == 0, done.stdout[-3000:]
    job_id = read_record(cfg.output_dir)["job_id"]
    output = job_output(cfg.output_dir, job_id)
    assert "srun --mpi=pmi2" in (cfg.output_dir / "slurm" / "train.sbatch").read_text()
    for rank in (0, 1):  # one process group of two, one rank on each node
        assert f"rank {rank}/2 (local 0/1)" in output, output[-3000:]
    assert read_progress(cfg.output_dir)["step"] == 20 and job_state(job_id) == "COMPLETED"


def test_a_two_rank_job_submitted_by_the_flow_trains_to_completion(slurm, prefect_server, mlp_sources, tmp_path):
    from ortflow.flows import train_pipeline

    cfg = mlp_config(tmp_path, mlp_sources, "slurm-done", distributed={"launcher": "slurm"}, slurm=TWO_NODES)
    state = train_pipeline(cfg, return_state=True)

    assert state.is_completed(), state
    summary = state.result()
    assert summary["steps"] == "20/20"
    record = read_record(cfg.output_dir)
    assert record["launcher"] == "slurm" and record["job_id"].isdigit()
    job_id = record["job_id"]
    assert summary["slurm job"] == job_id  # the run summary names the job
    assert job_state(job_id) == "COMPLETED"
    output = job_output(cfg.output_dir, job_id)
    assert f"slurm job {job_id} attempt 0 on node[1-2]" in output
    assert "step 20/20" in output
    for rank in (0, 1):  # one rank on each node of the allocation
        assert f"[{rank}] " in output and f"rank {rank}/2 (local 0/1)" in output, output[-3000:]
    assert read_progress(cfg.output_dir)["step"] == 20
    assert not in_queue(job_id)


def test_prefect_flow_run_cancel_leaves_a_stop_checkpoint_and_no_job(slurm, prefect_server, mlp_sources, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.testing.cli import CycloptsCliRunner

    base = mlp_config(tmp_path, mlp_sources, "slurm-served", distributed={"launcher": "slurm"}, slurm=TWO_NODES)
    env = {**prefect_server, "SLURM_CONF": slurm["SLURM_CONF"]}
    long = mlp_config(tmp_path, mlp_sources, "slurm-cancelled", distributed={"launcher": "slurm"}, slurm=TWO_NODES,
                      train={"num_train_steps": 200000, "display_loss_steps": 50, "evaluation_period": 0},
                      checkpoint={"period": 100000, "max_num_checkpoints": 1})
    with serving(write_config(base, tmp_path / "served.yaml"), env, "slurm-served", tmp_path, tmp_path / "serve.log"):
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train-pipeline/slurm-served")
            run = client.create_flow_run_from_deployment(deployment.id,
                                                         parameters={"config": long.model_dump(mode="json")})
        # A served run trains a new version folder; its job record appears when the job is submitted.
        folder = wait_for(lambda: next((p.parent for p in long.output_dir.glob("versions/*/launch.json")), None),
                          240, "the slurm job to be submitted")
        job_id = read_record(folder)["job_id"]
        wait_for(lambda: (read_progress(folder) or {}).get("step", 0) >= 20, 240, "the job to train")
        # Prefect's command, run in this process (its own in-process runner: no interpreter start, no imports again).
        cancel = CycloptsCliRunner().invoke(["flow-run", "cancel", str(run.id)])
        assert cancel.exit_code == 0 and "scheduled for cancellation" in cancel.output, cancel.output
        state = wait_for(lambda: read_flow_run(run.id).state if read_flow_run(run.id).state.is_final() else None,
                         180, "the flow run to end")
        assert state.name == "Cancelled", state
        wait_for(lambda: not in_queue(job_id), 180, "the slurm job to leave the queue")
    output = job_output(folder, job_id)
    stopped = re.search(r"stop requested: ranks stopped together after step (\d+)", output)
    assert stopped, output[-3000:]
    kept = list_complete(folder / "checkpoints")
    assert kept and kept[-1].step == int(stopped[1])  # the stop checkpoint, not a periodic one (period 100000)
    assert job_state(job_id) in ("FAILED", "CANCELLED", "COMPLETED")


def prepared(cfg, tmp_path: Path, name: str) -> Path:
    """Configure the run and prepare its data (in this process: the stages' own code, no CLI start-up)."""
    from ortflow.configure.configure import configure
    from ortflow.dataprep import prepare_data

    configure(cfg)
    prepare_data(cfg)
    return write_config(cfg, tmp_path / f"{name}.yaml")


def test_an_outside_scancel_stops_the_flows_run_without_resubmitting_it(slurm, prefect_server, mlp_sources,
                                                                         tmp_path):
    import threading

    from ortflow.flows import train_pipeline

    cfg = mlp_config(tmp_path, mlp_sources, "scancelled", distributed={"launcher": "slurm"}, slurm=TWO_NODES,
                     train={"num_train_steps": 200000, "display_loss_steps": 50, "evaluation_period": 0},
                     checkpoint={"period": 100000, "max_num_checkpoints": 1})  # fmt: skip
    cancelled: list[str] = []

    def cancel_from_outside() -> None:
        wait_for(lambda: (read_progress(cfg.output_dir) or {}).get("step", 0) >= 20, 300, "the job to train")
        cancelled.append(read_record(cfg.output_dir)["job_id"])
        subprocess.run(["scancel", cancelled[0]], check=True, timeout=60)

    canceller = threading.Thread(target=cancel_from_outside, daemon=True)
    canceller.start()
    state = train_pipeline(cfg, return_state=True)
    canceller.join(timeout=60)
    assert state.is_failed(), state
    job_id = cancelled[0]
    error = state.result(raise_on_failure=False)
    assert f"slurm job {job_id} was cancelled outside ortflow (scancel)" in str(error), error
    assert read_record(cfg.output_dir)["job_id"] == job_id  # not submitted again
    assert [p.name for p in (cfg.output_dir / "slurm").glob("job-*.out")] == [f"job-{job_id}.out"]
    assert not in_queue(job_id)


def test_a_request_the_cluster_can_never_start_is_refused_before_configure(slurm, prefect_server, mlp_sources,
                                                                            tmp_path):
    from ortflow.flows import train_pipeline

    # Three ranks on each of the two two-CPU nodes: Slurm would keep the job pending forever (PartitionConfig).
    cfg = mlp_config(tmp_path, mlp_sources, "impossible", distributed={"launcher": "slurm", "num_ranks": 6},
                     slurm=TWO_NODES)
    config_file = write_config(cfg, tmp_path / "impossible.yaml")
    checked = ortflow_here("validate", str(config_file))  # what it says and its status: in this process
    assert checked.returncode == 1 and "2 node(s) with 3 CPUs each" in checked.stdout, checked.stdout
    assert "sbatch --test-only refuses the run's job" in checked.stdout
    unknown = ortflow_here("validate", str(config_file), "--set", "slurm.partition=gpu", "--set",
                           "distributed.num_ranks=2")
    assert unknown.returncode == 1 and "slurm.partition 'gpu' does not exist" in unknown.stdout, unknown.stdout

    state = train_pipeline(cfg, return_state=True)
    assert state.is_failed(), state
    assert "2 node(s) with 3 CPUs each" in str(state.result(raise_on_failure=False))
    assert not cfg.artifacts_dir.exists() and not (cfg.output_dir / "slurm").exists()  # nothing configured or sent


def test_a_run_longer_than_its_time_limit_completes_across_allocations_with_no_failed_attempt(time_limited):
    cfg, future = time_limited  # the run trained while the tests above ran
    job_id, printed = future.result(timeout=540)
    run_dir = cfg.output_dir
    output = job_output(run_dir, job_id)
    requeues = output.count(REQUEUED_LINE)
    assert requeues >= 2 and f"slurm job {job_id} attempt {requeues} " in output, output[-3000:]
    stops = STOP_LINE.findall(output)
    starts = re.findall(r"\[0\] .* rank 0/2 .* starting from (.*)", output)
    assert len(stops) >= 2 and starts[-1].startswith(f"step {stops[-1]} "), (stops, starts)  # resumed from the last
    kept = [c.step for c in list_complete(cfg.checkpoints_dir)]
    assert kept == [int(stops[-1]), LIMITED_STEPS], kept  # the last stop checkpoint, then the end
    assert read_progress(run_dir)["step"] == LIMITED_STEPS
    record = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in record and f"Restarts={requeues}" in record  # requeued, then completed
    assert "FAILED" not in printed and "training finished" in printed
    assert [p.name for p in (run_dir / "slurm").glob("job-*.out")] == [f"job-{job_id}.out"]  # never resubmitted
