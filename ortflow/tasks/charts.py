"""The loss curve of a run, read back from its TensorBoard events, and drawn as a markdown artifact (an SVG image
plus a text chart that renders anywhere)."""

from __future__ import annotations

import base64
from pathlib import Path

CURVES = {"train": "train/loss", "eval": "eval/loss"}


def loss_curve(tensorboard_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train": [(step, loss), ...], "eval": [...]}`` from every event file of a run, sorted by step.

    A resumed run appends a new event file and may log a step again: the newest file's value of a step wins.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    tags = {tag: name for name, tag in CURVES.items()}
    points: dict[str, dict[int, float]] = {name: {} for name in CURVES}
    files = sorted(Path(tensorboard_dir).glob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name))
    for path in files:
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                name = tags.get(value.tag)
                if name is not None:
                    number = value.simple_value if value.HasField("simple_value") else _tensor_value(value)
                    points[name][int(event.step)] = float(number)
    return {name: sorted(values.items()) for name, values in points.items()}


def _tensor_value(value) -> float:
    import numpy as np
    from tensorboard.util import tensor_util

    return float(np.asarray(tensor_util.make_ndarray(value.tensor)).reshape(-1)[0])


def _svg(curve: dict[str, list[tuple[int, float]]], width: int = 640, height: int = 320) -> str:
    every = [p for series in curve.values() for p in series]
    steps = [s for s, _ in every]
    losses = [v for _, v in every]
    x0, x1 = min(steps), max(steps) or 1
    y0, y1 = min(losses), max(losses)
    pad, span_x, span_y = 40, (x1 - x0) or 1, (y1 - y0) or 1

    def xy(step: int, value: float) -> str:
        x = pad + (step - x0) / span_x * (width - 2 * pad)
        y = height - pad - (value - y0) / span_y * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    colors = {"train": "#1f77b4", "eval": "#d62728"}
    lines = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{pad}" y="14">loss {y0:.4g} .. {y1:.4g}, step {x0} .. {x1}</text>',
    ]
    for i, (name, series) in enumerate(curve.items()):
        if series:
            pts = " ".join(xy(s, v) for s, v in series)
            lines.append(f'<polyline fill="none" stroke="{colors.get(name, "black")}" stroke-width="1.5" '
                         f'points="{pts}"/>')
            lines.append(f'<text x="{width - 120}" y="{30 + 14 * i}" fill="{colors.get(name)}">{name} loss</text>')
    lines.append("</svg>")
    return "".join(lines)


def _text_chart(series: list[tuple[int, float]], width: int = 60) -> str:
    """One row of block characters, the series resampled to ``width`` columns."""
    if not series:
        return ""
    blocks = " ▁▂▃▄▅▆▇█"
    values = [series[int(i * len(series) / min(width, len(series)))][1] for i in range(min(width, len(series)))]
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    return "".join(blocks[1 + int((v - low) / span * (len(blocks) - 2))] for v in values)


def chart_markdown(name: str, curve: dict[str, list[tuple[int, float]]]) -> str:
    """The loss-curve artifact: an inline SVG chart, a text chart, and the points' ends."""
    if not any(curve.values()):
        return f"# Loss curve of `{name}`\n\nNo losses were logged (TensorBoard `train/loss`, `eval/loss`)."
    svg = base64.b64encode(_svg(curve).encode()).decode()
    lines = [f"# Loss curve of `{name}`", "", f"![loss curve](data:image/svg+xml;base64,{svg})", "", "```"]
    for label, series in curve.items():
        if series:
            lines.append(f"{label:5} {_text_chart(series)}  {series[0][1]:.4g} (step {series[0][0]}) -> "
                         f"{series[-1][1]:.4g} (step {series[-1][0]})")
    lines += ["```", "", "| step | train loss | eval loss |", "|---|---|---|"]
    train, evals = dict(curve.get("train", [])), dict(curve.get("eval", []))
    for step in sorted(set(train) | set(evals)):
        cells = [f"{d[step]:.6g}" if step in d else "" for d in (train, evals)]
        lines.append(f"| {step} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)
