"""The pipeline split: cut a model into stages, and a stage's forward with BatchNorm normalising by the batch."""
