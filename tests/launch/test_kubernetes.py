"""distributed.launcher kubernetes without a cluster: the MPIJob manifest against the MPI Operator's CRD schema, and
the client calls (create, log, status, delete) against a fake API object that keeps MPIJobs the way the server does."""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from ortflow.config import ConfigError, config_from_dict
from ortflow.launch import kubernetes, mpijob
from ortflow.launch.job import LaunchError, Phase, watch


def k8s_config(tmp_path: Path, num_ranks: int = 16, output_dir: None = None, **kubernetes_section) -> object:
    raw = {
        "name": "GPT_small.v2",
        "output_dir": str(tmp_path / "runs" / "gpt"),
        "model": {"path": str(tmp_path / "model.onnx")},
        "data": {"train": [str(tmp_path / "data.npz")]},
        "train": {"batch_size": 8, "num_train_steps": 100},
        "distributed": {"num_ranks": num_ranks, "launcher": "kubernetes", "device": "cuda", "use_nccl": True},
        "kubernetes": {"image": "registry.example.com/ortflow:0.1.0", "num_workers": 2, "gpus_per_worker": 8,
                       "cpu_per_worker": "96", "memory_per_worker": "900Gi",
                       "run_volume_mount_path": str(tmp_path / "runs"), **kubernetes_section},
    }
    return config_from_dict(raw)


def test_the_mpijob_for_2_workers_x_8_gpus_validates_against_the_crd_schema(tmp_path):
    cfg = k8s_config(tmp_path)
    manifest = mpijob.render(cfg)
    mpijob.validate(manifest)  # raises on any schema violation

    spec = manifest["spec"]
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"
    assert re.fullmatch(r"gpt-small-v2-[0-9a-f]{8}", manifest["metadata"]["name"])  # a DNS-1123 label
    assert spec["slotsPerWorker"] == 8 and spec["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert "-n 16 " in launcher["containers"][0]["command"][-1]
    for pod in (worker, launcher):  # the claim where it holds the run folder on the submitting host too
        assert pod["containers"][0]["volumeMounts"] == [{"name": "run-folder", "mountPath": str(tmp_path / "runs")}]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "ortflow-runs"
        assert pod["terminationGracePeriodSeconds"] == cfg.kubernetes.stop_grace_s


def test_the_kept_schema_is_the_operators_v2beta1_crd():
    text = mpijob.CRD_FILE.read_text()
    assert "https://github.com/kubeflow/mpi-operator/blob/v0.8.0/manifests/base/kubeflow.org_mpijobs.yaml" in text
    schema = mpijob.crd_schema()
    assert schema["properties"]["spec"]["required"] == ["mpiReplicaSpecs"]
    assert schema["properties"]["spec"]["properties"]["mpiImplementation"]["enum"] == ["OpenMPI", "Intel", "MPICH"]


@pytest.mark.parametrize(("path", "value", "named"), [
    (("spec", "mpiImplementation"), "OpenMPI5", "spec.mpiImplementation"),
    (("spec", "slotsPerWorker"), "eight", "spec.slotsPerWorker"),
    (("spec", "mpiReplicaSpecs", "Worker", "template", "spec", "containers", 0, "volumeMounts", 0, "mountPath"), 7,
     "mountPath"),
    (("spec", "mpiReplicaSpecs", "Worker", "template", "spec", "containers", 0, "resources", "limits", "memory"),
     "lots", "resources.limits.memory"),
])
def test_a_manifest_that_breaks_the_schema_is_refused_naming_the_path(tmp_path, path, value, named):
    manifest = copy.deepcopy(mpijob.render(k8s_config(tmp_path)))
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(mpijob.ManifestError, match=named.replace(".", r"\.")):
        mpijob.validate(manifest)


def test_the_config_refuses_what_an_mpijob_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match=r"num_ranks \(15\) must be a multiple of kubernetes.num_workers \(2\)"):
        k8s_config(tmp_path, num_ranks=15)
    with pytest.raises(ConfigError, match="needs kubernetes.image"):
        k8s_config(tmp_path, image=None)


class FakeApi:
    """CustomObjectsApi + CoreV1Api over a dict, as the API server and the MPI Operator would change it: MPIJobs get a
    uid, deletes honour a uid precondition, pods are selected by their labels, logs carry timestamps and honour
    ``since_seconds``; ``advance`` moves the stored MPIJobs through their conditions and grows the launcher's log."""

    def __init__(self, now: datetime | None = None):
        self.jobs: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple] = []
        self.logs: dict[str, list[tuple[datetime, str]]] = {}  # launcher pod -> its stamped lines
        self.now = now or datetime(2026, 11, 28, 12, 0, 0, tzinfo=UTC)
        self.uids = iter(range(1, 1000))

    def clock(self) -> datetime:
        return self.now

    # CustomObjectsApi
    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", group, version, namespace, plural, body["metadata"]["name"]))
        mpijob.validate(body)  # what the API server does with the CRD's schema
        key = (namespace, body["metadata"]["name"])
        if key in self.jobs:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(body)
        stored["metadata"]["uid"] = f"uid-{next(self.uids)}"
        self.jobs[key] = stored
        return copy.deepcopy(stored)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", name))
        if (namespace, name) not in self.jobs:
            raise ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.jobs[(namespace, name)])

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None):
        self.calls.append(("delete", group, version, namespace, plural, name,
                           getattr(body, "propagation_policy", None)))  # fmt: skip
        if (namespace, name) not in self.jobs:
            raise ApiException(status=404, reason="NotFound")
        uid = getattr(getattr(body, "preconditions", None), "uid", None)
        if uid is not None and self.jobs[(namespace, name)]["metadata"]["uid"] != uid:
            raise ApiException(status=409, reason="Conflict: the precondition's uid does not match")
        del self.jobs[(namespace, name)]

    # CoreV1Api
    def _pods(self, namespace: str, selector: str) -> list[SimpleNamespace]:
        wanted = dict(term.split("=", 1) for term in selector.split(","))
        pods = []
        for (ns, name), job in self.jobs.items():
            labels = {**job["metadata"]["labels"], mpijob.JOB_NAME_LABEL: name}
            for role in ("launcher", "worker"):
                if ns == namespace and {**labels, mpijob.JOB_ROLE_LABEL: role}.items() >= wanted.items():
                    meta = SimpleNamespace(name=f"{name}-{role}", creation_timestamp=self.now)
                    pods.append(SimpleNamespace(metadata=meta))
        return pods

    def list_namespaced_pod(self, namespace, label_selector=""):
        self.calls.append(("list_pods", namespace, label_selector))
        return SimpleNamespace(items=[pod for pod in self._pods(namespace, label_selector)
                                      if self.logs.get(pod.metadata.name)])

    def read_namespaced_pod_log(self, name, namespace, timestamps=False, since_seconds=None):
        self.calls.append(("log", name, since_seconds))
        assert timestamps, "the launcher's log is read with timestamps"
        since = self.now - timedelta(seconds=since_seconds) if since_seconds else None
        return "".join(f"{t.strftime('%Y-%m-%dT%H:%M:%S.%f')}123Z {line}\n"
                       for t, line in self.logs.get(name, []) if since is None or t >= since)  # fmt: skip

    def delete_namespaced_pod(self, name, namespace, body=None):
        self.calls.append(("delete_pod", name))

    def advance(self, condition: str | None = None, lines: tuple[str, ...] = (), seconds: float = 5) -> None:
        self.now += timedelta(seconds=seconds)
        for _, name in self.jobs:  # every job's launcher prints them
            self.logs.setdefault(f"{name}-launcher", []).extend(
                (self.now + timedelta(microseconds=i), line) for i, line in enumerate(lines))
        if condition:
            for job in self.jobs.values():
                job.setdefault("status", {}).setdefault("conditions", []).append({"type": condition, "status": "True"})


def test_submit_creates_a_valid_mpijob_and_a_retry_attaches_to_it(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    assert job.job_id == f"default/{mpijob.job_name(cfg)}"
    assert [c for c in api.calls if c[0] == "create"] == [
        ("create", "kubeflow.org", "v2beta1", "default", "mpijobs", mpijob.job_name(cfg))]
    api.advance("Created")
    again = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)  # a retried task: the job still runs
    assert again.job_id == job.job_id
    assert len([c for c in api.calls if c[0] == "create"]) == 1


def test_watch_streams_the_launcher_log_once_and_reports_success(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    script = iter([("Created", ()), ("Running", ("[0] step 1/100",)), (None, ("[0] step 2/100", "[1] done")),
                   ("Succeeded", ("[0] step 100/100",))])  # fmt: skip
    lines: list[str] = []
    result = watch(job, lines.append, poll_s=5, sleep=lambda s: api.advance(*next(script, (None, ()))))
    assert result.returncode == 0 and result.launcher == "kubernetes" and result.job_id == job.job_id
    assert [line for line in lines if not line.startswith("ortflow:")] == [
        "[0] step 1/100", "[0] step 2/100", "[1] done", "[0] step 100/100"]
    assert lines[0] == f"ortflow: kubernetes job {job.job_id} is pending: submitted"  # said while it waits


def test_the_launcher_log_is_read_incrementally_not_whole_every_poll(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    api.advance("Running", tuple(f"[0] step {i}/100" for i in range(1, 51)))
    first = job.read_output()
    api.advance(None, ("[0] step 51/100",), seconds=5)
    second = job.read_output()
    api.advance(None, (), seconds=5)
    third = job.read_output()
    assert first == [f"[0] step {i}/100" for i in range(1, 51)] and second == ["[0] step 51/100"] and third == []
    reads = [c for c in api.calls if c[0] == "log"]
    assert reads[0][2] is None  # the first read takes what there is
    assert all(0 < since <= 12 for _, _, since in reads[1:]), reads  # later ones only the seconds since the last line


def test_cancel_deletes_the_mpijob_and_waits_for_it_to_go(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    api.advance("Running", ("[0] step 1/100",))
    ticks = iter(range(1000))

    def sleep(_seconds: float) -> None:
        if next(ticks) == 2:
            raise KeyboardInterrupt  # the flow is cancelled while the job runs

    with pytest.raises(KeyboardInterrupt):
        watch(job, lambda line: None, poll_s=5, grace_s=90, sleep=sleep, clock=lambda: float(next(ticks)))
    deletes = [c for c in api.calls if c[0] == "delete"]
    assert deletes == [("delete", "kubeflow.org", "v2beta1", "default", "mpijobs", job.name, "Foreground")]
    assert api.jobs == {}
    assert job.poll().phase is Phase.ENDED
    assert not [c for c in api.calls if c[0] == "delete_pod"]  # gone within the grace period: nothing forced


def test_a_failed_mpijob_reports_its_message(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    api.jobs[("default", job.name)]["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "message": "launcher pod failed"}]}
    result = watch(job, lambda line: None, sleep=lambda s: None)
    assert result.returncode == 1 and not result.ok


def docs_example(tmp_path: Path, **sections) -> object:
    """docs/clusters.md's Kubernetes example (its first YAML block with `launcher: kubernetes`), with its paths moved
    under ``tmp_path``."""
    text = (Path(__file__).parents[2] / "docs" / "clusters.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "launcher: kubernetes" in b)
    raw = yaml.safe_load(block.replace("/runs", str(tmp_path / "runs")))
    raw["kubernetes"]["run_volume_mount_path"] = str(tmp_path / "runs")
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def test_the_documented_example_and_a_gpu_example_render_strictly_valid_mpijobs(tmp_path):
    documented = mpijob.render(docs_example(tmp_path))
    mpijob.validate(documented)
    gpu = docs_example(tmp_path, kubernetes={
        "shm_size": "32Gi", "launcher_cpu": "1", "launcher_memory": "2Gi", "node_selector": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "image_pull_secrets": ["registry-login"], "scheduler_name": "volcano", "scheduling_queue": "research",
        "priority_class": "high", "labels": {"kueue.x-k8s.io/queue-name": "team-a"}, "run_volume_sub_path": "team-a"})
    manifest = mpijob.render(gpu)
    mpijob.validate(manifest)
    spec = manifest["spec"]
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert worker["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert worker["imagePullSecrets"] == [{"name": "registry-login"}] and worker["schedulerName"] == "volcano"
    assert worker["priorityClassName"] == "high"
    assert spec["runPolicy"]["schedulingPolicy"] == {"queue": "research", "minAvailable": 3, "priorityClass": "high"}
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert launcher["containers"][0]["resources"] == {"limits": {"cpu": "1", "memory": "2Gi"},
                                                      "requests": {"cpu": "1", "memory": "2Gi"}}
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    for pod in (worker, launcher):
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
        assert pod["containers"][0]["volumeMounts"] == [
            {"name": "run-folder", "mountPath": str(tmp_path / "runs"), "subPath": "team-a"},
            {"name": "dshm", "mountPath": "/dev/shm"}]


def test_the_claim_is_mounted_where_it_holds_the_run_folder(tmp_path):
    cfg = docs_example(tmp_path)
    assert cfg.output_dir == tmp_path / "runs" / "gpt-small"  # the docs' claim holds /runs, the run is /runs/NAME
    pod = mpijob.render(cfg)["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    mount = pod["containers"][0]["volumeMounts"][0]
    assert mount == {"name": "run-folder", "mountPath": str(tmp_path / "runs")}
    assert cfg.output_dir.is_relative_to(mount["mountPath"])  # the resolved config's paths hold in the pods
    with pytest.raises(ConfigError, match=r"output_dir .* is not under kubernetes.run_volume_mount_path /data"):
        docs_example(tmp_path, kubernetes={"run_volume_mount_path": "/data"})


@pytest.mark.parametrize(("path", "value", "named"), [
    (("spec", "slotPerWorker"), 8, "slotPerWorker"),
    (("spec", "mpiReplicaSpecs", "Worker", "template", "spec", "tolerations"),
     [{"key": "a", "efect": "NoSchedule"}], "efect"),
    (("spec", "mpiReplicaSpecs", "Worker", "template", "spec", "containers", 0, "volumeMount"), [], "volumeMount"),
    (("spec", "mpiReplicaSpecs", "Workers"), {"replicas": 1}, "Workers"),
    (("metadata", "lables"), {}, "lables"),
])
def test_unknown_fields_are_refused_as_strict_field_validation_does(tmp_path, path, value, named):
    manifest = copy.deepcopy(mpijob.render(k8s_config(tmp_path)))
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(mpijob.ManifestError, match=named):
        mpijob.validate(manifest)


def test_two_runs_of_one_name_in_other_folders_never_share_or_delete_each_others_job(tmp_path):
    api = FakeApi()
    first = k8s_config(tmp_path, output_dir=None)
    second = config_from_dict({**first.model_dump(mode="json"), "output_dir": str(tmp_path / "runs" / "other")})
    job_a = kubernetes.submit(first, custom=api, core=api, clock=api.clock)
    api.advance("Running", ("[0] run a",))
    job_b = kubernetes.submit(second, custom=api, core=api, clock=api.clock)  # same name, its own job
    assert job_a.name != job_b.name and len(api.jobs) == 2
    assert job_a.labels[mpijob.RUN_ID_LABEL] != job_b.labels[mpijob.RUN_ID_LABEL]
    assert job_b.read_output() == []  # not the other run's launcher log
    assert job_a.read_output() == ["[0] run a"]
    job_b.cancel()
    assert list(api.jobs) == [("default", job_a.name)]  # only its own job is gone
    assert job_a.poll().phase is Phase.RUNNING


def test_a_job_of_the_same_name_that_another_run_owns_is_refused_not_attached(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    foreign = mpijob.render(cfg)
    foreign["metadata"]["labels"][mpijob.RUN_ID_LABEL] = "0123456789abcdef"
    api.create_namespaced_custom_object("kubeflow.org", "v2beta1", "default", "mpijobs", foreign)
    with pytest.raises(LaunchError, match="belongs to another run"):
        kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    assert [c for c in api.calls if c[0] == "delete"] == []


def test_a_cancel_leaves_a_job_that_replaced_the_watched_one(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    api.jobs.clear()  # deleted by someone else, then submitted again (a new uid)
    kubernetes.submit(cfg, custom=api, core=api, clock=api.clock)
    assert job.poll().phase is Phase.ENDED  # the job it watched is gone
    job.cancel()
    assert len(api.jobs) == 1  # the replacement stays


def test_versions_of_one_run_get_their_own_jobs_and_version_labels(tmp_path):
    base = k8s_config(tmp_path)
    v1 = config_from_dict({**base.model_dump(mode="json"), "output_dir": str(base.output_dir / "versions" / "v1")})
    labels = mpijob.run_labels(v1)
    assert labels[mpijob.VERSION_LABEL] == "v1"
    assert labels[mpijob.RUN_ID_LABEL] == mpijob.run_labels(base)[mpijob.RUN_ID_LABEL]  # one run, two versions
    assert mpijob.job_name(v1) != mpijob.job_name(base)
