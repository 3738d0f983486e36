"""Write this example's model, model.onnx, next to this script: a byte-level GPT (4 layers, width 128).

Run by `make demo` before the pipeline; the bytes are the same on every run (fixed seed), so configure reuses its
artifacts after the first run.

    python examples/gpt/build_model.py [OUTPUT]
"""

from __future__ import annotations

import sys
from pathlib import Path

from ortflow.examples import build_gpt
from ortflow.examples.write import GPT_SIZES as SIZES  # the same model `ortflow example gpt DIR` writes


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "model.onnx"
    build_gpt(out, **SIZES)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
