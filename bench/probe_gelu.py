"""Whether the CUDA engine trains the fused GELU (graph/gelu.py) in fp16 and bf16: run on a GPU.

``python bench/probe_gelu.py ROOT``: for fp32, fp16 and bf16, the small GPT of bench/probe_precision.py with its GELUs
fused (forced on even for bf16, where ``engine_input.gelu_fusion`` leaves them as exported), artifacts, a CUDA
session with verbose logging, three updates and one eval (``probe_precision.attempt``). Prints one ``RESULT {json}``
line per precision: the losses, or the engine's error; and whether Gelu / GeluGrad were placed on the CPU provider
(no CUDA kernel for that type).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probe_precision import _placements, attempt  # noqa: E402


def forced(root: Path, precision: str) -> dict:
    import onnx

    from ortflow.build import engine_input

    engine_input.gelu_fusion = lambda cfg: True  # the probe's point: bf16 too
    result = attempt(root / precision, precision, [])
    graph = onnx.load(str(next((root / precision).glob("*/artifacts/training_model.onnx"))), load_external_data=False)
    result["gelu_ops"] = sorted({n.op_type for n in graph.graph.node} & {"Gelu", "GeluGrad", "Erf"})
    return result


def main(root: Path) -> None:
    for precision in ("fp32", "fp16", "bf16"):
        (root / precision).mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, __file__, "attempt", str(root), precision], capture_output=True,
                              text=True, timeout=300, check=False)
        text = proc.stderr + proc.stdout
        placed, _ = _placements(text)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        result = json.loads(line[7:]) if line else {"precision": precision, "error": text[-2000:]}
        result["gelu_on_cpu"] = sorted(placed & {"Gelu", "GeluGrad", "FastGelu", "FastGeluGrad"})
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "attempt":
        print("RESULT " + json.dumps(forced(Path(sys.argv[2]), sys.argv[3])), flush=True)
    else:
        main(Path(sys.argv[1]))
