"""The committed real exports (tools/export_fixtures.py): a Hugging Face GPT-2, a Hugging Face BERT classifier and a
torch CNN with BatchNorm, as users export them."""

import hashlib
import json
from pathlib import Path

EXPORTS = Path(__file__).resolve().parents[1] / "fixtures" / "exports"
VERSIONS = json.loads((EXPORTS / "versions.json").read_text())
NAMES = ("gpt2.onnx", "bert.onnx", "cnn.onnx")


def export_path(name: str) -> Path:
    """Path of a committed export, after checking it is the file tools/export_fixtures.py wrote."""
    path = EXPORTS / name
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != VERSIONS["sha256"][name]:
        raise RuntimeError(f"{path} differs from the export recorded in versions.json: re-run tools/export_fixtures.sh")
    return path
