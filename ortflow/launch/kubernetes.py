"""The Kubernetes launcher: submit the run's MPIJob, follow its launcher pod's log and its conditions, delete it on
cancel; through the official ``kubernetes`` client (kubeconfig, or the pod's service account inside a cluster).

The manifest comes from :func:`ortflow.launch.mpijob.render` and is checked against the MPI Operator's CRD schema
before it is sent. A second submission for the same run (a retried task) attaches to the MPIJob of that name while it
has not finished, and replaces a finished one, so one run folder never has two writers.
"""

from __future__ import annotations

import logging
from typing import Any

from ortflow.config import RunConfig
from ortflow.launch.job import JobState, LaunchError, Phase
from ortflow.launch.mpijob import GROUP, JOB_NAME_LABEL, JOB_ROLE_LABEL, PLURAL, VERSION, render, validate

log = logging.getLogger(__name__)


def _condition(manifest: dict, kind: str) -> dict | None:
    for condition in (manifest.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
    return None


class KubernetesJob:
    """An MPIJob of one run: the launcher pod's log as output, the job's conditions as state.

    Args:
        name: The MPIJob's name.
        namespace: Its namespace.
        custom: A ``kubernetes.client.CustomObjectsApi`` (or an object with the same methods).
        core: A ``kubernetes.client.CoreV1Api`` (or an object with the same methods).
    """

    launcher = "kubernetes"

    def __init__(self, name: str, namespace: str, custom: Any, core: Any):
        self.name, self.namespace = name, namespace
        self.job_id = f"{namespace}/{name}"
        self.custom, self.core = custom, core
        self._seen = 0

    def manifest(self) -> dict | None:
        """The MPIJob as the API server has it (status included), None once it is gone."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def read_output(self) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        selector = f"{JOB_NAME_LABEL}={self.name},{JOB_ROLE_LABEL}=launcher"
        try:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
            if not pods:
                return []
            # The newest launcher pod; its whole log is read and the lines not yet forwarded are returned.
            pod = max(pods, key=lambda p: p.metadata.creation_timestamp or 0)
            text = self.core.read_namespaced_pod_log(pod.metadata.name, self.namespace)
        except ApiException as err:
            if err.status in (400, 404):  # the container is not started yet, or already gone
                return []
            raise
        lines = text.splitlines()
        new, self._seen = lines[self._seen:], len(lines)
        return new

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
        """Delete the MPIJob: its pods get SIGTERM and their termination grace period for the stop checkpoint."""
        from kubernetes.client import V1DeleteOptions
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.name,
                body=V1DeleteOptions(propagation_policy="Foreground"),
            )
            log.info("deleted MPIJob %s", self.job_id)
        except ApiException as err:
            if err.status != 404:
                raise

    def kill(self) -> None:
        """Delete the MPIJob's pods without a grace period."""
        from kubernetes.client import V1DeleteOptions

        self.cancel()
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_NAME_LABEL}={self.name}").items
        for pod in pods:
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


def submit(cfg: RunConfig, custom: Any = None, core: Any = None) -> KubernetesJob:
    """Render, validate and create the run's MPIJob (or attach to the unfinished one of the same name).

    Args:
        cfg: The run config (distributed.launcher kubernetes).
        custom: CustomObjectsApi (default: from the kubeconfig).
        core: CoreV1Api (default: from the kubeconfig).

    Raises:
        ManifestError: the manifest breaks the CRD schema.
        LaunchError: no credentials.
    """
    manifest = render(cfg)
    validate(manifest)
    if custom is None or core is None:
        custom, core = clients()
    meta = manifest["metadata"]
    job = KubernetesJob(meta["name"], meta["namespace"], custom, core)
    state = job.poll() if job.manifest() is not None else None
    if state is not None and state.phase is not Phase.ENDED:
        log.info("attaching to MPIJob %s, still %s", job.job_id, state.detail)
        return job
    if state is not None:  # a finished MPIJob of an earlier attempt holds the name
        custom.delete_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL, meta["name"])
    custom.create_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL, manifest)
    log.info("created MPIJob %s (%d workers x %d ranks)", job.job_id, cfg.kubernetes.num_workers,
             manifest["spec"]["slotsPerWorker"])
    return job
