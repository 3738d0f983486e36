"""Deployments: the pipeline and export-only flows served with the config's schedule (``ortflow serve``)."""

from ortflow.deployments.serving import build_deployments, config_schedules, serve_config

__all__ = ["build_deployments", "config_schedules", "serve_config"]
