"""The Kubeflow MPI Operator's ``MPIJob`` (``kubeflow.org/v2beta1``) of a run, and its check against the CRD's schema.

The operator starts ``kubernetes.num_workers`` worker pods running sshd, writes their names into a host file, and
then a launcher pod that runs ``mpiexec`` over ssh: ``num_ranks / num_workers`` ranks (``slotsPerWorker``) on each
worker. Every pod mounts the run folder's volume claim at ``kubernetes.run_volume_mount_path`` (the folder that holds
``output_dir`` on the submitting host too; ``run_volume_sub_path`` picks a folder of the claim), so the resolved
config the ranks load holds inside the pods unchanged. The MPIJob and its pods carry the run's labels (a hash of the
run folder and the version's name): a job is only ever taken for a run's own when its labels say so.

Stopping: when the MPIJob is deleted, Kubernetes sends SIGTERM to every pod. The launcher's ``mpiexec`` passes it on
to the ranks; each worker's entry script also passes it to its own ranks and waits for them to exit before it stops
sshd (a container ends when its first process does, which would kill the ranks mid-checkpoint). The ranks stop after
the same update with a stop checkpoint, within ``kubernetes.stop_grace_s`` (the pods' termination grace period).

The schema kept in ``crds/kubeflow.org_mpijobs.yaml`` is the operator's own CRD (source and release in its header).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import re
import shlex
from pathlib import Path

import yaml

from ortflow.config import RunConfig
from ortflow.protocol import NUM_RANKS_ENV, THREADS_ENV

API_VERSION = "kubeflow.org/v2beta1"
GROUP, VERSION, PLURAL = "kubeflow.org", "v2beta1", "mpijobs"
CRD_FILE = Path(__file__).with_name("crds") / "kubeflow.org_mpijobs.yaml"
#: Labels the operator puts on the pods it makes (its v2beta1 constants): how the launcher pod is found.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
RUN_VOLUME = "run-folder"


class ManifestError(ValueError):
    """The rendered MPIJob does not satisfy the CRD's schema; the message names each path and problem."""


RUN_ID_LABEL = "ortflow.run-id"  # the run folder (a version's base folder), hashed
VERSION_LABEL = "ortflow.version"  # the version folder's name (versions/NAME), empty for an unversioned run
SHM_VOLUME = "dshm"


def _digest(path: Path) -> str:
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()


def run_labels(cfg: RunConfig) -> dict[str, str]:
    """The labels that tie an MPIJob and its pods to one run folder: the run (base folder) and the version."""
    folder = Path(cfg.output_dir).resolve()
    version = ""
    if folder.parent.name == "versions":  # a deployment's version folder: BASE/versions/NAME
        version, folder = folder.name, folder.parent.parent
    version = re.sub(r"[^A-Za-z0-9_.-]+", "-", version).strip("-_.")[:63].strip("-_.")
    return {RUN_ID_LABEL: _digest(folder)[:16], VERSION_LABEL: version}


def job_name(cfg: RunConfig) -> str:
    """The MPIJob's name: the run name as a DNS-1123 label and 8 hex digits of the run folder's path, so runs of one
    name in other folders (or versions) never share a job; at most 50 characters so that the operator's
    ``-launcher`` and ``-worker-N`` pod names stay within 63."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-")[:41].strip("-")
    name = name if name[:1].isalpha() else f"r-{name}"[:41].strip("-")
    return f"{name}-{_digest(cfg.output_dir)[:8]}"


def _env(cfg: RunConfig) -> list[dict[str, str]]:
    threads = cfg.distributed.threads_per_rank or 1
    values = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
              THREADS_ENV: threads, NUM_RANKS_ENV: cfg.distributed.num_ranks,
              "PYTHONUNBUFFERED": 1, "NCCL_NVLS_ENABLE": 0}  # fmt: skip
    return [{"name": name, "value": str(value)} for name, value in values.items()]


def launcher_command(cfg: RunConfig) -> list[str]:
    """The launcher container's command: the bundled MPICH's ``mpiexec`` over the operator's host file."""
    k8s, run_dir = cfg.kubernetes, str(cfg.output_dir)
    mpiexec = f"$(dirname $(command -v {shlex.quote(k8s.python)}))/mpiexec"
    rank = f"{shlex.quote(k8s.python)} -u -P -m ortflow.trainer {shlex.quote(run_dir)}"
    # exec: mpiexec is the container's first process, so the pod's SIGTERM reaches it and it passes it to the ranks.
    return ["/bin/sh", "-c", f"exec {mpiexec} -n {cfg.distributed.num_ranks} -prepend-rank {rank}"]


#: The worker's entry: sshd for the launcher's mpiexec; on SIGTERM, the local ranks get it too and sshd stops only
#: once they have exited (their stop checkpoint written).
#: (The pattern ``[o]rtflow[.]trainer`` matches the ranks' command lines but not this script's own.)
WORKER_SCRIPT = (
    "/usr/sbin/sshd -De & sshd=$!; "
    "trap 'pkill -TERM -f \"[o]rtflow[.]trainer\"; while pgrep -f \"[o]rtflow[.]trainer\" >/dev/null; "
    "do sleep 1; done; kill $sshd' TERM; "
    "wait $sshd"
)


def _resources(cpu: str | None, memory: str | None, gpus: int = 0) -> dict:
    amounts: dict[str, object] = {}
    if gpus:
        amounts["nvidia.com/gpu"] = gpus
    if cpu:
        amounts["cpu"] = cpu
    if memory:
        amounts["memory"] = memory
    return {"limits": amounts, "requests": dict(amounts)} if amounts else {}


def _container(cfg: RunConfig, role: str, command: list[str], resources: dict) -> dict:
    k8s = cfg.kubernetes
    mount = {"name": RUN_VOLUME, "mountPath": k8s.run_volume_mount_path}
    if k8s.run_volume_sub_path:
        mount["subPath"] = k8s.run_volume_sub_path
    mounts = [mount] + ([{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] if k8s.shm_size else [])
    container = {"name": role, "image": k8s.image, "imagePullPolicy": k8s.image_pull_policy, "command": command,
                 "env": _env(cfg), "volumeMounts": mounts}  # fmt: skip
    if resources:
        container["resources"] = resources
    return container


def _pod_spec(cfg: RunConfig, container: dict) -> dict:
    k8s = cfg.kubernetes
    volumes: list[dict] = [{"name": RUN_VOLUME, "persistentVolumeClaim": {"claimName": k8s.run_volume_claim}}]
    if k8s.shm_size:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}})
    spec: dict = {"containers": [container], "terminationGracePeriodSeconds": k8s.stop_grace_s, "volumes": volumes}
    optional = {
        "serviceAccountName": k8s.service_account,
        "schedulerName": k8s.scheduler_name,
        "priorityClassName": k8s.priority_class,
        "nodeSelector": dict(k8s.node_selector),
        "imagePullSecrets": [{"name": name} for name in k8s.image_pull_secrets],
        "tolerations": [_toleration(t) for t in k8s.tolerations],
    }
    spec.update({key: value for key, value in optional.items() if value})
    return spec


def _toleration(toleration) -> dict:
    fields = {"key": toleration.key, "operator": toleration.operator, "value": toleration.value,
              "effect": toleration.effect, "tolerationSeconds": toleration.toleration_seconds}  # fmt: skip
    return {key: value for key, value in fields.items() if value is not None}


def _run_policy(cfg: RunConfig) -> dict:
    k8s = cfg.kubernetes
    # A failed launcher is not restarted by the operator: the train task's retries resume from checkpoints.
    policy: dict = {"cleanPodPolicy": "Running", "backoffLimit": 0}
    if k8s.scheduling_queue:  # gang scheduling: the pod group starts whole (launcher and every worker) or not at all
        group = {"queue": k8s.scheduling_queue, "minAvailable": k8s.num_workers + 1}
        if k8s.priority_class:
            group["priorityClass"] = k8s.priority_class
        policy["schedulingPolicy"] = group
    return policy


def render(cfg: RunConfig) -> dict:
    """The MPIJob manifest of a run (distributed.launcher kubernetes; counts checked by the config)."""
    k8s, ranks = cfg.kubernetes, int(cfg.distributed.num_ranks)
    labels = {**k8s.labels, "app.kubernetes.io/name": "ortflow", **run_labels(cfg)}
    launcher = _container(cfg, "launcher", launcher_command(cfg), _resources(k8s.launcher_cpu, k8s.launcher_memory))
    worker = _container(cfg, "worker", ["/bin/sh", "-c", WORKER_SCRIPT],
                        _resources(k8s.cpu_per_worker, k8s.memory_per_worker, k8s.gpus_per_worker))
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {"name": job_name(cfg), "namespace": k8s.namespace, "labels": dict(labels)},
        "spec": {
            "slotsPerWorker": ranks // k8s.num_workers,
            "mpiImplementation": "MPICH",
            "launcherCreationPolicy": "WaitForWorkersReady",
            "runPolicy": _run_policy(cfg),
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never",
                             "template": {"metadata": {"labels": dict(labels)}, "spec": _pod_spec(cfg, launcher)}},
                "Worker": {"replicas": k8s.num_workers, "restartPolicy": "Never",
                           "template": {"metadata": {"labels": dict(labels)}, "spec": _pod_spec(cfg, worker)}},
            },
        },
    }


@functools.cache
def crd_schema() -> dict:
    """The v2beta1 OpenAPI schema of the MPIJob CRD kept in the package."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    return next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == VERSION)


#: What the API server itself checks of an object's own metadata (the CRD leaves it to the server).
_OBJECT_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,  # what a manifest sets; the server adds uid, resourceVersion, ... itself
}


def _closed(schema: object) -> object:
    """``schema`` with every object that lists its properties closed to others (``additionalProperties: false``):
    the API server's strict field validation refuses unknown fields where the schema does not preserve them."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: (value if key == "enum" else _closed(value)) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        closed["additionalProperties"] = False
    return closed


@functools.cache
def strict_schema() -> dict:
    """The CRD's schema as the API server applies it with strict field validation: unknown fields refused, the
    object's metadata checked, and only the operator's two replica kinds (Launcher, Worker)."""
    schema = copy.deepcopy(_closed(crd_schema()))
    schema["properties"]["metadata"] = _OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    replicas = schema["properties"]["spec"]["properties"]["mpiReplicaSpecs"]
    replicas["propertyNames"] = {"enum": ["Launcher", "Worker"]}
    return schema


def validate(manifest: dict) -> None:
    """Check ``manifest`` against the MPIJob CRD's OpenAPI schema, as the API server would on create with strict
    field validation: a field the schema does not know (a misspelling) is refused, as is a wrong type or value.

    Raises:
        ManifestError: naming every path that breaks the schema.
    """
    from jsonschema import Draft7Validator

    problems = sorted(Draft7Validator(strict_schema()).iter_errors(manifest), key=lambda e: list(e.absolute_path))
    problems = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in problems]
    for path in _quantities(manifest):
        problems.append(f"{path}: not a Kubernetes quantity")
    if problems:
        raise ManifestError("the MPIJob does not match the MPI Operator's CRD schema:\n" +
                            "\n".join(f"  - {p}" for p in problems))


_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[mkMGTPE])?$")


def _quantities(manifest: dict) -> list[str]:
    """Resource values the schema leaves free (int-or-string) but the API server parses as quantities."""
    bad = []
    for role, replica in manifest.get("spec", {}).get("mpiReplicaSpecs", {}).items():
        for i, container in enumerate(replica.get("template", {}).get("spec", {}).get("containers", [])):
            for kind in ("limits", "requests"):
                for key, value in container.get("resources", {}).get(kind, {}).items():
                    if not _QUANTITY.match(str(value)):
                        bad.append(f"spec.mpiReplicaSpecs.{role}.template.spec.containers.{i}.resources.{kind}.{key}")
    return bad
