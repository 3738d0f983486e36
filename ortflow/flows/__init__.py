"""Prefect flows: ``train_pipeline`` (the whole run) and ``export_only`` (one checkpoint to an inference model)."""

from ortflow.flows.pipeline import export_only, train_pipeline

__all__ = ["export_only", "train_pipeline"]
