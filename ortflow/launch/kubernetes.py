"""The Kubernetes launcher: submit the run's MPIJob, follow its launcher pod's log and its conditions, delete it on
cancel; through the official ``kubernetes`` client (kubeconfig, or the pod's service account inside a cluster).

The manifest comes from :func:`ortflow.launch.mpijob.render` and is checked strictly against the MPI Operator's CRD
schema before it is sent. A job belongs to a run by its labels (the run folder's hash and the version,
:func:`ortflow.launch.mpijob.run_labels`), never by its name alone: a second submission for the same run (a retried
task) attaches to that run's unfinished MPIJob and replaces its finished one, and an MPIJob of the same name that
another run owns is refused, never attached to or deleted. Deletes carry the job's uid as a precondition, so a cancel
removes the job it watched and nothing that replaced it.

The launcher's log is read incrementally: each poll asks only for the seconds since the last line seen
(``sinceSeconds`` with timestamps) and forwards the lines newer than that line.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Callable
from typing import Any

from ortflow.config import RunConfig
from ortflow.launch.job import JobState, LaunchError, Phase
from ortflow.launch.mpijob import GROUP, JOB_NAME_LABEL, JOB_ROLE_LABEL, PLURAL, VERSION, render, run_labels, validate

log = logging.getLogger(__name__)


def _condition(manifest: dict, kind: str) -> dict | None:
    for condition in (manifest.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
    return None


def _timestamp(text: str) -> datetime.datetime | None:
    """An RFC 3339 timestamp as the API server writes it before each log line (nanoseconds cut to microseconds)."""
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        return datetime.datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")
    except ValueError:
        return None


class LogReader:
    """The new lines of one pod's log since the last call, asking the server only for the recent seconds.

    Args:
        read: ``read(since_seconds)`` returns the log with a timestamp before each line (None: the whole log).
        clock: The current time (UTC, aware).
    """

    def __init__(self, read: Callable[[int | None], str], clock: Callable[[], datetime.datetime]):
        self.read, self.clock = read, clock
        self.last: datetime.datetime | None = None
        self.seen_at_last: set[str] = set()  # lines stamped exactly `last` already forwarded

    def new_lines(self) -> list[str]:
        since = None if self.last is None else max(1, math.ceil((self.clock() - self.last).total_seconds()) + 1)
        lines = []
        for raw in self.read(since).splitlines():
            stamp_text, _, line = raw.partition(" ")
            stamp = _timestamp(stamp_text)
            if stamp is None:  # not stamped (a continuation): belongs to the line before
                lines.append(raw)
                continue
            if self.last is not None and (stamp < self.last or (stamp == self.last and line in self.seen_at_last)):
                continue
            if self.last is None or stamp > self.last:
                self.last, self.seen_at_last = stamp, set()
            self.seen_at_last.add(line)
            lines.append(line)
        return lines


class KubernetesJob:
    """An MPIJob of one run: the launcher pod's log as output, the job's conditions as state.

    Args:
        name: The MPIJob's name.
        namespace: Its namespace.
        labels: The run's labels (run id, version) the job and its pods carry.
        custom: A ``kubernetes.client.CustomObjectsApi`` (or an object with the same methods).
        core: A ``kubernetes.client.CoreV1Api`` (or an object with the same methods).
        clock: The current time (UTC, aware; tests pass their own).
    """

    launcher = "kubernetes"

    def __init__(self, name: str, namespace: str, labels: dict[str, str], custom: Any, core: Any,
                 clock: Callable[[], datetime.datetime] | None = None):
        self.name, self.namespace, self.labels = name, namespace, labels
        self.job_id = f"{namespace}/{name}"
        self.custom, self.core = custom, core
        self.uid: str | None = None
        self.clock = clock or (lambda: datetime.datetime.now(datetime.UTC))
        self._pod: str | None = None
        self._reader: LogReader | None = None

    def selector(self, role: str | None = None) -> str:
        """The label selector of this run's pods of the job (``role``: launcher or worker)."""
        terms = [f"{JOB_NAME_LABEL}={self.name}", *(f"{key}={value}" for key, value in self.labels.items())]
        return ",".join(terms + ([f"{JOB_ROLE_LABEL}={role}"] if role else []))

    def owns(self, manifest: dict) -> bool:
        """Whether ``manifest`` (an MPIJob as the server has it) is this run's: its labels carry the run's."""
        labels = (manifest.get("metadata") or {}).get("labels") or {}
        return all(labels.get(key) == value for key, value in self.labels.items())

    def manifest(self) -> dict | None:
        """This run's MPIJob as the API server has it (status included); None once it is gone or replaced."""
        from kubernetes.client.exceptions import ApiException

        try:
            found = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        uid = (found.get("metadata") or {}).get("uid")
        if not self.owns(found) or (self.uid and uid and uid != self.uid):
            return None
        return found

    def read_output(self) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        try:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector("launcher")).items
            if not pods:
                return []
            pod = max(pods, key=lambda p: p.metadata.creation_timestamp or 0).metadata.name  # the newest launcher
            if pod != self._pod:
                self._pod = pod
                self._reader = LogReader(lambda since: self._read_log(pod, since), self.clock)
            return self._reader.new_lines()
        except ApiException as err:
            if err.status in (400, 404):  # the container is not started yet, or already gone
                return []
            raise

    def _read_log(self, pod: str, since_seconds: int | None) -> str:
        options = {"timestamps": True} | ({"since_seconds": since_seconds} if since_seconds else {})
        return self.core.read_namespaced_pod_log(pod, self.namespace, **options)

    def poll(self) -> JobState:
        manifest = self.manifest()
        if manifest is None:
            return JobState(Phase.ENDED, "deleted", 143)
        if _condition(manifest, "Succeeded"):
            return JobState(Phase.ENDED, "Succeeded", 0)
        if failed := _condition(manifest, "Failed"):
            return JobState(Phase.ENDED, f"Failed: {failed.get('message', '')}".strip(), 1)
        if _condition(manifest, "Running"):
            return JobState(Phase.RUNNING, "Running")
        return JobState(Phase.PENDING, "Created" if _condition(manifest, "Created") else "submitted")

    def cancel(self) -> None:
        """Delete this run's MPIJob: its pods get SIGTERM and their termination grace period for the stop
        checkpoint. The uid precondition keeps a job that replaced it (another submission) alive."""
        from kubernetes.client import V1DeleteOptions, V1Preconditions
        from kubernetes.client.exceptions import ApiException

        if self.uid is None:
            found = self.manifest()
            if found is None:
                return
            self.uid = found["metadata"].get("uid")
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name,
                body=V1DeleteOptions(propagation_policy="Foreground", preconditions=V1Preconditions(uid=self.uid)),
            )
            log.info("deleted MPIJob %s", self.job_id)
        except ApiException as err:
            if err.status not in (404, 409):  # gone, or no longer the job this run watched
                raise

    def kill(self) -> None:
        """Delete this run's pods of the job without a grace period."""
        from kubernetes.client import V1DeleteOptions

        self.cancel()
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=self.selector()).items:
            self.core.delete_namespaced_pod(pod.metadata.name, self.namespace,
                                            body=V1DeleteOptions(grace_period_seconds=0))


def clients() -> tuple[Any, Any]:
    """CustomObjectsApi and CoreV1Api from the kubeconfig, or from the service account inside a cluster."""
    from kubernetes import client, config

    try:
        config.load_kube_config()
    except Exception:  # noqa: BLE001 - no kubeconfig: try the in-cluster service account before giving up
        try:
            config.load_incluster_config()
        except config.ConfigException as err:
            raise LaunchError(
                f"distributed.launcher kubernetes: no cluster credentials ({err}): set KUBECONFIG or run inside a "
                "pod with a service account allowed to create mpijobs.kubeflow.org"
            ) from None
    return client.CustomObjectsApi(), client.CoreV1Api()


def submit(cfg: RunConfig, custom: Any = None, core: Any = None,
           clock: Callable[[], datetime.datetime] | None = None) -> KubernetesJob:
    """Render, validate and create the run's MPIJob (or attach to this run's unfinished one).

    Args:
        cfg: The run config (distributed.launcher kubernetes).
        custom: CustomObjectsApi (default: from the kubeconfig).
        core: CoreV1Api (default: from the kubeconfig).
        clock: The current time (UTC, aware) for the log reads (default: the system's).

    Raises:
        ManifestError: the manifest breaks the CRD schema.
        LaunchError: no credentials, or an MPIJob of the same name belongs to another run.
    """
    from kubernetes.client import V1DeleteOptions, V1Preconditions

    manifest = render(cfg)
    validate(manifest)
    if custom is None or core is None:
        custom, core = clients()
    meta = manifest["metadata"]
    job = KubernetesJob(meta["name"], meta["namespace"], run_labels(cfg), custom, core, clock)
    existing = _existing(job)
    if existing is not None:
        if not job.owns(existing):
            raise LaunchError(
                f"MPIJob {job.job_id} exists but belongs to another run (labels {existing['metadata'].get('labels')}, "
                f"this run's {job.labels}): delete it (kubectl delete mpijob -n {job.namespace} {job.name}) or "
                "rename this run")
        job.uid = existing["metadata"].get("uid")
        state = job.poll()
        if state.phase is not Phase.ENDED:
            log.info("attaching to MPIJob %s, still %s", job.job_id, state.detail)
            return job
        # this run's finished MPIJob of an earlier attempt holds the name
        custom.delete_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, job.name,
                                               body=V1DeleteOptions(preconditions=V1Preconditions(uid=job.uid)))
    created = custom.create_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, manifest)
    job.uid = ((created or {}).get("metadata") or {}).get("uid")
    log.info("created MPIJob %s (%d workers x %d ranks)", job.job_id, cfg.kubernetes.num_workers,
             manifest["spec"]["slotsPerWorker"])
    return job


def _existing(job: KubernetesJob) -> dict | None:
    """The MPIJob of the job's name as the server has it, whoever owns it."""
    from kubernetes.client.exceptions import ApiException

    try:
        return job.custom.get_namespaced_custom_object(GROUP, VERSION, job.namespace, PLURAL, job.name)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
