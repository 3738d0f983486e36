"""The Kubeflow MPI Operator's ``MPIJob`` (``kubeflow.org/v2beta1``) of a run, and its check against the CRD's schema.

The operator starts ``kubernetes.num_workers`` worker pods running sshd, writes their names into a host file, and
then a launcher pod that runs ``mpiexec`` over ssh: ``num_ranks / num_workers`` ranks (``slotsPerWorker``) on each
worker. Every pod mounts the run folder's volume claim at ``output_dir``'s own path, so the resolved config the ranks
load holds inside the pods unchanged.

Stopping: when the MPIJob is deleted, Kubernetes sends SIGTERM to every pod. The launcher's ``mpiexec`` passes it on
to the ranks; each worker's entry script also passes it to its own ranks and waits for them to exit before it stops
sshd (a container ends when its first process does, which would kill the ranks mid-checkpoint). The ranks stop after
the same update with a stop checkpoint, within ``kubernetes.stop_grace_s`` (the pods' termination grace period).

The schema kept in ``crds/kubeflow.org_mpijobs.yaml`` is the operator's own CRD (source and release in its header).
"""

from __future__ import annotations

import functools
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


def job_name(cfg: RunConfig) -> str:
    """The MPIJob's name: the run name as a DNS-1123 label (lower case, ``-`` for other characters, at most 50
    characters so that the operator's ``-launcher`` and ``-worker-N`` pod names stay within 63)."""
    name = re.sub(r"[^a-z0-9-]+", "-", cfg.name.lower()).strip("-")[:50].strip("-")
    return f"ortflow-{name}" if not name[:1].isalpha() else name


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


def _container(cfg: RunConfig, role: str, command: list[str], resources: dict) -> dict:
    k8s = cfg.kubernetes
    container = {
        "name": role,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": command,
        "env": _env(cfg),
        "volumeMounts": [{"name": RUN_VOLUME, "mountPath": str(cfg.output_dir)}],
    }
    if resources:
        container["resources"] = {"limits": resources, "requests": dict(resources)}
    return container


def _pod_spec(cfg: RunConfig, container: dict) -> dict:
    k8s = cfg.kubernetes
    spec = {
        "containers": [container],
        "terminationGracePeriodSeconds": k8s.stop_grace_s,
        "volumes": [{"name": RUN_VOLUME, "persistentVolumeClaim": {"claimName": k8s.run_volume_claim}}],
    }
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    return spec


def render(cfg: RunConfig) -> dict:
    """The MPIJob manifest of a run (distributed.launcher kubernetes; counts checked by the config)."""
    k8s, ranks = cfg.kubernetes, int(cfg.distributed.num_ranks)
    worker_resources: dict[str, object] = {}
    if k8s.gpus_per_worker:
        worker_resources["nvidia.com/gpu"] = k8s.gpus_per_worker
    if k8s.cpu_per_worker:
        worker_resources["cpu"] = k8s.cpu_per_worker
    if k8s.memory_per_worker:
        worker_resources["memory"] = k8s.memory_per_worker
    name = job_name(cfg)
    labels = {"app.kubernetes.io/name": "ortflow", "ortflow.run": name}
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {"name": name, "namespace": k8s.namespace, "labels": labels},
        "spec": {
            "slotsPerWorker": ranks // k8s.num_workers,
            "mpiImplementation": "MPICH",
            "launcherCreationPolicy": "WaitForWorkersReady",
            # A failed launcher is not restarted by the operator: the train task's retries resume from checkpoints.
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {"metadata": {"labels": labels},
                                 "spec": _pod_spec(cfg, _container(cfg, "launcher", launcher_command(cfg), {}))},
                },
                "Worker": {
                    "replicas": k8s.num_workers,
                    "restartPolicy": "Never",
                    "template": {"metadata": {"labels": labels},
                                 "spec": _pod_spec(cfg, _container(cfg, "worker", ["/bin/sh", "-c", WORKER_SCRIPT],
                                                                   worker_resources))},
                },
            },
        },
    }


@functools.cache
def crd_schema() -> dict:
    """The v2beta1 OpenAPI schema of the MPIJob CRD kept in the package."""
    crd = yaml.safe_load(CRD_FILE.read_text())
    return next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == VERSION)


def validate(manifest: dict) -> None:
    """Check ``manifest`` against the MPIJob CRD's OpenAPI schema, as the API server would on create.

    Raises:
        ManifestError: naming every path that breaks the schema.
    """
    from jsonschema import Draft7Validator

    problems = sorted(Draft7Validator(crd_schema()).iter_errors(manifest), key=lambda e: list(e.absolute_path))
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
