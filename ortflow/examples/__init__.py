"""Builders of small example ONNX models (an MLP classifier and a GPT-style decoder).

Tests, the bundled example and the benchmarks make their models here, with ``onnx.helper`` only: no torch, and
nothing from the rest of ortflow. Every builder writes opset 17, IR 9, which the engine runs.
"""

from ortflow.examples.gpt import build_gpt
from ortflow.examples.mlp import build_mlp

__all__ = ["build_gpt", "build_mlp"]
