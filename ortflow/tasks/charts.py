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


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """``count`` evenly spaced values from ``low`` to ``high`` (one when they are equal)."""
    if high == low:
        return [low]
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def _svg(curve: dict[str, list[tuple[int, float]]], width: int = 640, height: int = 320) -> str:
    """The loss curves as an SVG line chart with axes, ticks, tick labels, axis titles and a legend."""
    every = [p for series in curve.values() for p in series]
    steps = [s for s, _ in every]
    losses = [v for _, v in every]
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(losses), max(losses)
    left, right, top, bottom = 64, 16, 28, 44  # room for the tick labels and axis titles
    span_x, span_y = (x1 - x0) or 1, (y1 - y0) or 1
    plot_w, plot_h = width - left - right, height - top - bottom

    def x_of(step: float) -> float:
        return left + (step - x0) / span_x * plot_w

    def y_of(value: float) -> float:
        return top + plot_h - (value - y0) / span_y * plot_h

    colors = {"train": "#1f77b4", "eval": "#d62728"}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>',
    ]
    for value in _ticks(y0, y1):
        y = y_of(value)
        out.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="black"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.4g}</text>')
    for step in sorted({round(v) for v in _ticks(x0, x1)}):
        x = x_of(step)
        out.append(f'<line x1="{x:.1f}" y1="{top + plot_h}" x2="{x:.1f}" y2="{top + plot_h + 4}" stroke="black"/>')
        out.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{step}</text>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 6}" text-anchor="middle">step</text>')
    out.append(f'<text x="14" y="{top + plot_h / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + plot_h / 2:.1f})">loss</text>')
    for i, (name, series) in enumerate(curve.items()):
        if not series:
            continue
        color = colors.get(name, "black")
        if len(series) == 1:
            (step, value), = series
            out.append(f'<circle cx="{x_of(step):.1f}" cy="{y_of(value):.1f}" r="3" fill="{color}"/>')
        else:
            points = " ".join(f"{x_of(s):.1f},{y_of(v):.1f}" for s, v in series)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{points}"/>')
        lx = left + plot_w - 180 + 90 * i
        out.append(f'<line x1="{lx}" y1="14" x2="{lx + 14}" y2="14" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{lx + 18}" y="18">{name} loss</text>')
    out.append("</svg>")
    return "".join(out)


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
