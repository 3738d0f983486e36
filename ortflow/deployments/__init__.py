"""Deployments: the pipeline and export-only flows served with the config's schedule (``ortflow serve``)."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ortflow.deployments.serving import build_deployments, config_schedules, serve_config

__all__ = ["build_deployments", "config_schedules", "serve_config"]


def __getattr__(name: str):
    # The serving names are imported when first asked for: they import Prefect's runner and deployments, which
    # `ortflow run` (it needs only :mod:`.local_server`) never uses.
    if name in __all__:
        from ortflow.deployments import serving

        value = getattr(serving, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
