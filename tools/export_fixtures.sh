#!/usr/bin/env bash
# Re-export the real-model test fixtures (tests/fixtures/exports) with pinned torch and transformers, in a throwaway
# virtual environment: ortflow and its tests never install torch. torch 2.13.0 from PyPI is a large download.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
venv=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$venv")"' EXIT
"$PYTHON" -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0 transformers==4.48.0 onnx==1.17.0 onnxscript==0.7.2 \
    safetensors==0.8.0 numpy==2.4.6
"$venv/bin/python" tools/export_fixtures.py tests/fixtures/exports
