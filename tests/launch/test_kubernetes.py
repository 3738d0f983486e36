"""distributed.launcher kubernetes without a cluster: the MPIJob manifest against the MPI Operator's CRD schema, and
the client calls (create, log, status, delete) against a fake API object that keeps MPIJobs the way the server does."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from ortflow.config import ConfigError, config_from_dict
from ortflow.launch import kubernetes, mpijob
from ortflow.launch.job import Phase, watch


def k8s_config(tmp_path: Path, num_ranks: int = 16, **kubernetes_section) -> object:
    raw = {
        "name": "GPT_small.v2",
        "output_dir": str(tmp_path / "runs" / "gpt"),
        "model": {"path": str(tmp_path / "model.onnx")},
        "data": {"train": [str(tmp_path / "data.npz")]},
        "train": {"batch_size": 8, "num_train_steps": 100},
        "distributed": {"num_ranks": num_ranks, "launcher": "kubernetes", "device": "cuda", "use_nccl": True},
        "kubernetes": {"image": "registry.example.com/ortflow:0.1.0", "num_workers": 2, "gpus_per_worker": 8,
                       "cpu_per_worker": "96", "memory_per_worker": "900Gi", **kubernetes_section},
    }
    return config_from_dict(raw)


def test_the_mpijob_for_2_workers_x_8_gpus_validates_against_the_crd_schema(tmp_path):
    cfg = k8s_config(tmp_path)
    manifest = mpijob.render(cfg)
    mpijob.validate(manifest)  # raises on any schema violation

    spec = manifest["spec"]
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1" and manifest["kind"] == "MPIJob"
    assert manifest["metadata"]["name"] == "gpt-small-v2"  # a DNS-1123 label
    assert spec["slotsPerWorker"] == 8 and spec["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    worker = spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    launcher = spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert "-n 16 " in launcher["containers"][0]["command"][-1]
    for pod in (worker, launcher):  # the run folder at the path the resolved config names
        assert pod["containers"][0]["volumeMounts"] == [{"name": "run-folder", "mountPath": str(cfg.output_dir)}]
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
    """CustomObjectsApi + CoreV1Api over a dict, as the API server and the MPI Operator would change it: ``advance``
    moves the stored MPIJob through its conditions and grows the launcher pod's log."""

    def __init__(self):
        self.jobs: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple] = []
        self.log: list[str] = []

    # CustomObjectsApi
    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", group, version, namespace, plural, body["metadata"]["name"]))
        mpijob.validate(body)  # what the API server does with the CRD's schema
        key = (namespace, body["metadata"]["name"])
        if key in self.jobs:
            raise ApiException(status=409, reason="AlreadyExists")
        self.jobs[key] = copy.deepcopy(body)
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", name))
        if (namespace, name) not in self.jobs:
            raise ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.jobs[(namespace, name)])

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, body=None):
        self.calls.append(("delete", group, version, namespace, plural, name,
                           getattr(body, "propagation_policy", None)))  # fmt: skip
        if self.jobs.pop((namespace, name), None) is None:
            raise ApiException(status=404, reason="NotFound")

    # CoreV1Api
    def list_namespaced_pod(self, namespace, label_selector=""):
        self.calls.append(("list_pods", namespace, label_selector))
        name = label_selector.split(",")[0].split("=")[1]
        if (namespace, name) not in self.jobs or not self.log:
            return SimpleNamespace(items=[])
        meta = SimpleNamespace(name=f"{name}-launcher-abcde", creation_timestamp=datetime.now(UTC))
        return SimpleNamespace(items=[SimpleNamespace(metadata=meta)])

    def read_namespaced_pod_log(self, name, namespace):
        self.calls.append(("log", name))
        return "".join(line + "\n" for line in self.log)

    def delete_namespaced_pod(self, name, namespace, body=None):
        self.calls.append(("delete_pod", name))

    def advance(self, condition: str | None = None, lines: tuple[str, ...] = ()) -> None:
        self.log.extend(lines)
        if condition:
            for job in self.jobs.values():
                job.setdefault("status", {}).setdefault("conditions", []).append({"type": condition, "status": "True"})


def test_submit_creates_a_valid_mpijob_and_a_retry_attaches_to_it(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api)
    assert job.job_id == "default/gpt-small-v2"
    assert [c for c in api.calls if c[0] == "create"] == [
        ("create", "kubeflow.org", "v2beta1", "default", "mpijobs", "gpt-small-v2")]
    api.advance("Created")
    again = kubernetes.submit(cfg, custom=api, core=api)  # a retried task: the job still runs
    assert again.job_id == job.job_id
    assert len([c for c in api.calls if c[0] == "create"]) == 1


def test_watch_streams_the_launcher_log_once_and_reports_success(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api)
    script = iter([("Created", ()), ("Running", ("[0] step 1/100",)), (None, ("[0] step 2/100", "[1] done")),
                   ("Succeeded", ("[0] step 100/100",))])  # fmt: skip
    lines: list[str] = []
    result = watch(job, lines.append, poll_s=5, sleep=lambda s: api.advance(*next(script, (None, ()))))
    assert result.returncode == 0 and result.launcher == "kubernetes" and result.job_id == "default/gpt-small-v2"
    assert lines == ["[0] step 1/100", "[0] step 2/100", "[1] done", "[0] step 100/100"]


def test_cancel_deletes_the_mpijob_and_waits_for_it_to_go(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api)
    api.advance("Running", ("[0] step 1/100",))
    ticks = iter(range(1000))

    def sleep(_seconds: float) -> None:
        if next(ticks) == 2:
            raise KeyboardInterrupt  # the flow is cancelled while the job runs

    with pytest.raises(KeyboardInterrupt):
        watch(job, lambda line: None, poll_s=5, grace_s=90, sleep=sleep, clock=lambda: float(next(ticks)))
    deletes = [c for c in api.calls if c[0] == "delete"]
    assert deletes == [("delete", "kubeflow.org", "v2beta1", "default", "mpijobs", "gpt-small-v2", "Foreground")]
    assert api.jobs == {}
    assert job.poll().phase is Phase.ENDED
    assert not [c for c in api.calls if c[0] == "delete_pod"]  # gone within the grace period: nothing forced


def test_a_failed_mpijob_reports_its_message(tmp_path):
    cfg, api = k8s_config(tmp_path), FakeApi()
    job = kubernetes.submit(cfg, custom=api, core=api)
    api.jobs[("default", "gpt-small-v2")]["status"] = {
        "conditions": [{"type": "Failed", "status": "True", "message": "launcher pod failed"}]}
    result = watch(job, lambda line: None, sleep=lambda s: None)
    assert result.returncode == 1 and not result.ok
