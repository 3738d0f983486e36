"""The sections of the scheduler launchers: the Slurm job (``slurm``) and the Kubeflow MPIJob (``kubernetes``)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ortflow.config.base import Section, absolute_path

_SLURM_TIME = r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$"
_SBATCH_LINE = r"^--?[A-Za-z][^\n\r]*$"
#: A Kubernetes quantity as the configs write them (16, 500m, 64Gi).
_CPU = r"^\d+(\.\d+)?m?$"
_MEMORY = r"^\d+(\.\d+)?([KMGTPE]i?)?$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"
#: A label or annotation key (optional DNS prefix, then a name of letters, digits, ``-_.``) and a label value.
_LABEL_KEY = r"^([a-z0-9]([-.a-z0-9]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_LABEL_VALUE = r"^(|[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$"


#: Slurm sends the time limit's --signal at its periodic time-limit check, up to this many seconds late.
SLURM_LIMIT_CHECK_S = 30


def slurm_time_s(value: str) -> int:
    """Seconds of a Slurm time limit as ``--time`` reads it: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS,
    DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS (0: no limit)."""
    days, _, rest = value.rpartition("-")
    parts = [int(part) for part in rest.split(":")]
    if days:  # DAYS-HOURS[:MINUTES[:SECONDS]]
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    hours, minutes, seconds = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return (hours * 60 + minutes) * 60 + seconds


class SlurmConfig(Section):
    """The sbatch job of distributed.launcher slurm: distributed.num_ranks ranks over num_nodes nodes."""

    num_nodes: int = Field(1, gt=0, description="Nodes of the allocation (#SBATCH --nodes); num_ranks / num_nodes "
                           "ranks start on each.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (#SBATCH --gpus-per-node); 0 asks for none.")
    cpus_per_rank: int | None = Field(
        None, gt=0, description="CPUs per rank (#SBATCH --cpus-per-task; default: distributed.threads_per_rank or 1)."
    )
    partition: str | None = Field(None, min_length=1, description="Partition (#SBATCH --partition; default: the "
                                  "cluster's default).")
    time_limit: str | None = Field(
        None, pattern=_SLURM_TIME,
        description="Wall-clock limit of one allocation as Slurm writes it (MINUTES, HH:MM:SS or DAYS-HH:MM:SS; "
        "#SBATCH --time). A run longer than this continues in further allocations of the same job "
        "(stop_signal_s).",
    )
    account: str | None = Field(None, min_length=1, description="Account charged (#SBATCH --account).")
    extra_sbatch: list[Annotated[str, Field(pattern=_SBATCH_LINE)]] = Field(
        [], description='Further sbatch options, one per entry, each written as "#SBATCH <entry>" (e.g. "--qos=high", '
        '"--constraint=a100").',
    )
    setup: list[str] = Field(
        [], description="Shell lines the job runs before the ranks start (module load ..., source /path/venv/bin/"
        "activate); the nodes need ortflow's Python environment and the run folder at the same paths.",
    )
    stop_signal_s: int = Field(
        180, ge=0, le=86400,
        description="Seconds before the time limit that the job gets SIGUSR1 (#SBATCH --signal=B:USR1@N): the ranks "
        "stop after the current update with a stop checkpoint and the job requeues itself (needs requeue), so the "
        "next allocation resumes from it; 0: no early signal.",
    )
    requeue: bool = Field(
        True, description="Let the job be requeued (#SBATCH --requeue): after a preemption or node failure, and by "
        "itself at the time limit; a requeued job resumes from the newest complete checkpoint.",
    )
    launch: Literal["mpiexec", "srun"] = Field(
        "mpiexec",
        description="How the job starts the ranks: mpiexec (slurm.mpiexec inside the allocation) or srun (srun "
        "--mpi=srun_mpi, the site's process manager; mpi4py must be built against the site's MPI, docs/clusters.md).",
    )
    srun_mpi: str = Field("pmi2", pattern=r"^[a-z0-9_]+$", description="srun's --mpi plugin with launch srun (pmi2, "
                          "pmix, ...; `srun --mpi=list` shows the site's).")
    mpiexec: str | None = Field(
        None, description="MPI launcher the job runs inside the allocation (default: the mpiexec beside this Python, "
        "the bundled MPICH, which starts its processes on the allocated nodes with srun). It must be of the MPI that "
        "mpi4py is built against (`ortflow doctor`). A relative path resolves against the config's folder.",
    )
    python: str | None = Field(
        None, min_length=1, description="Python of ortflow's environment on the nodes (default: the submitting "
        "process's; in a container image: its own, /opt/ortflow/bin/python for docker/Dockerfile). A relative path "
        "resolves against the config's folder; a bare name (python3) is looked up on the nodes' PATH.",
    )
    rank_prefix: list[str] = Field(
        [], description="Command words before each rank's Python: a container runner, so the ranks run in the image "
        "(e.g. [apptainer, exec, --bind, /shared, /shared/ortflow.sif] or [enroot, start, --mount, /shared, "
        "ortflow]; docs/clusters.md).",
    )
    poll_interval_s: float = Field(2.0, gt=0, le=600, description="Seconds between job state queries (scontrol).")

    @field_validator("time_limit", mode="before")
    @classmethod
    def _minutes(cls, value: object) -> object:
        """``time_limit: 30`` (MINUTES), which YAML reads as a number, is Slurm's time as written."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _time_to_train(self) -> SlurmConfig:
        limit_s = slurm_time_s(self.time_limit) if self.time_limit else 0
        if limit_s and self.stop_signal_s and limit_s - self.stop_signal_s - SLURM_LIMIT_CHECK_S <= 0:
            raise ValueError(
                f"slurm.stop_signal_s ({self.stop_signal_s}) leaves no time to train in slurm.time_limit "
                f"{self.time_limit!r} ({limit_s} s): Slurm sends the stop signal stop_signal_s before the limit, up to "
                f"{SLURM_LIMIT_CHECK_S} s earlier, so every allocation would stop and requeue at once; lower "
                f"stop_signal_s or raise time_limit (stop_signal_s < time_limit - {SLURM_LIMIT_CHECK_S} s)"
            )
        return self

    @field_validator("python", "mpiexec", mode="after")
    @classmethod
    def _command_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A relative path (``.venv/bin/python``) resolves against the config's folder, as every path of the config
        does: the job runs in the run folder. A bare command name (``python3``) stays one, found on the nodes' PATH."""
        if value is None or "/" not in value:
            return value
        return str(absolute_path(value, (info.context or {}).get("base_dir")))

    @field_validator("rank_prefix")
    @classmethod
    def _words(cls, value: list[str]) -> list[str]:
        if any(not word.strip() for word in value):
            raise ValueError("every entry is one non-empty command word (e.g. [apptainer, exec, /shared/ortflow.sif])")
        return value


class Toleration(Section):
    """One toleration of the pods (Kubernetes' Toleration): lets them run on nodes with a matching taint."""

    key: str | None = Field(None, min_length=1, description="Taint key (unset with operator Exists: every taint).")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: key and value match; Exists: the key.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect tolerated (unset: every effect).")
    toleration_seconds: int | None = Field(None, ge=0, description="With effect NoExecute: seconds the pod stays "
                                           "bound after the taint appears.")


class KubernetesConfig(Section):
    """The Kubeflow MPIJob (kubeflow.org/v2beta1) of distributed.launcher kubernetes: a launcher pod runs mpiexec,
    num_workers worker pods run distributed.num_ranks / num_workers ranks each."""

    image: str | None = Field(
        None, min_length=1, description="Container image of launcher and workers: ortflow's pinned environment with "
        "sshd (docker/Dockerfile, docs/clusters.md); required with launcher kubernetes.",
    )
    namespace: str = Field("default", pattern=_DNS_LABEL, description="Namespace of the MPIJob.")
    num_workers: int = Field(1, gt=0, description="Worker pods (replicas of the Worker); num_ranks / num_workers "
                             "ranks (slotsPerWorker) on each.")
    gpus_per_worker: int = Field(0, ge=0, description="nvidia.com/gpu limit of each worker pod.")
    cpu_per_worker: str | None = Field(None, pattern=_CPU, description="CPU request and limit of each worker pod "
                                       "(Kubernetes quantity, e.g. 16 or 500m).")
    memory_per_worker: str | None = Field(None, pattern=_MEMORY, description="Memory request and limit of each "
                                          "worker pod (e.g. 64Gi).")
    launcher_cpu: str | None = Field(None, pattern=_CPU, description="CPU request and limit of the launcher pod "
                                     "(it only runs mpiexec: e.g. 1).")
    launcher_memory: str | None = Field(None, pattern=_MEMORY, description="Memory request and limit of the "
                                        "launcher pod (e.g. 1Gi).")
    shm_size: str | None = Field(
        None, pattern=_MEMORY,
        description="Size of /dev/shm in every pod: an in-memory emptyDir of this sizeLimit mounted there (NCCL and "
        "MPI's shared memory need more than a container runtime's 64 MB; e.g. 16Gi); unset: the runtime's.",
    )
    run_volume_claim: str = Field(
        "ortflow-runs", pattern=_DNS_SUBDOMAIN,
        description="PersistentVolumeClaim (ReadWriteMany) holding the run folder; every pod mounts it at "
        "run_volume_mount_path.",
    )
    run_volume_mount_path: str = Field(
        "/runs", pattern=r"^/",
        description="Where the pods mount the claim: the folder that holds output_dir (and the checkpoints) at the "
        "same path on the submitting host, so the resolved config's paths hold inside the pods (a claim holding "
        "/runs: /runs).",
    )
    run_volume_sub_path: str | None = Field(
        None, pattern=r"^[^/].*$",
        description="Folder inside the claim mounted at run_volume_mount_path (volumeMounts subPath, relative); "
        "unset: the claim's root.",
    )
    node_selector: dict[str, str] = Field(
        {}, description="Node labels the pods must run on (nodeSelector, e.g. {nvidia.com/gpu.product: "
        "NVIDIA-H100-80GB-HBM3}).",
    )
    tolerations: list[Toleration] = Field([], description="Tolerations of the pods (e.g. {key: nvidia.com/gpu, "
                                          "operator: Exists, effect: NoSchedule} for tainted GPU nodes).")
    image_pull_secrets: list[str] = Field(
        [], description="Secrets (type kubernetes.io/dockerconfigjson) the pods pull a private image with.")
    scheduler_name: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="schedulerName of the pods (e.g. "
                                       "volcano for gang scheduling; unset: the default scheduler).")
    scheduling_queue: str | None = Field(
        None, min_length=1,
        description="runPolicy.schedulingPolicy.queue: the Volcano (or scheduler-plugins) queue of the job's pod "
        "group, which the operator creates with every pod as its minimum (all-or-nothing start).",
    )
    priority_class: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="priorityClassName of the pods "
                                       "(and of the pod group with scheduling_queue).")
    labels: dict[str, str] = Field(
        {}, description="Further labels of the MPIJob and its pods, e.g. {kueue.x-k8s.io/queue-name: team-a} to "
        "admit it through a Kueue LocalQueue.",
    )
    service_account: str | None = Field(None, pattern=_DNS_SUBDOMAIN, description="Service account of the pods "
                                        "(default: the namespace's).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy "
                                                                          "of both containers.")
    python: str = Field("python", min_length=1, description="Python of ortflow's environment inside the image.")
    poll_interval_s: float = Field(5.0, gt=0, le=600, description="Seconds between MPIJob status reads.")
    stop_grace_s: int = Field(
        60, ge=0, le=3600,
        description="terminationGracePeriodSeconds of the pods: on cancel the MPIJob is deleted and the ranks get "
        "SIGTERM, stop after the current update with a stop checkpoint, and are killed after this many seconds.",
    )

    @field_validator("node_selector", "labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not re.match(_LABEL_KEY, key) or len(key.rpartition("/")[2]) > 63:
                raise ValueError(f"{key!r} is not a Kubernetes label key (an optional DNS prefix and /, then at most "
                                 "63 letters, digits, -, _ or .)")
            if not re.match(_LABEL_VALUE, text):
                raise ValueError(f"{key}: {text!r} is not a Kubernetes label value (at most 63 letters, digits, -, _ "
                                 "or ., starting and ending with a letter or digit)")
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.match(_DNS_SUBDOMAIN, name):
                raise ValueError(f"{name!r} is not a Secret name (lower-case letters, digits, - and .)")
        return value
