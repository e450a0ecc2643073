"""The usage page's chart: completion tokens (input and output) a day, one bar a day stacked by
model, drawn on the server as SVG, so it reads without a script."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

WIDTH, HEIGHT = 720, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 28
COLOURS = 8  # ``.series-0`` to ``.series-7`` in app.css; models past the seventh share the last
TICKS = 4


@dataclass(frozen=True)
class Segment:
    x: float
    y: float
    width: float
    height: float
    series: int
    title: str  # the tooltip: day, model, tokens


@dataclass(frozen=True)
class Chart:
    segments: list[Segment]
    days: list[tuple[float, str]]  # a label's x and text, for some of the days
    ticks: list[tuple[float, str]]  # a gridline's y and its token count
    legend: list[tuple[int, str]]  # a colour and the model (or "other models") it stands for
    total: int
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom_y: int = HEIGHT - BOTTOM

    @property
    def middle(self) -> float:
        return (self.left + self.width) / 2


def _tokens(result: dict[str, Any]) -> int:
    return result["input_tokens"] + result["output_tokens"]


def daily_tokens_chart(buckets: list[dict[str, Any]]) -> Chart:
    """``buckets``: a day's each, grouped by model, as ``usage.report.usage_page`` gives them."""
    by_model: dict[str, int] = {}
    for bucket in buckets:
        for result in bucket["results"]:
            by_model[result["model"]] = by_model.get(result["model"], 0) + _tokens(result)
    ranked = sorted(by_model, key=lambda model: (-by_model[model], model))
    series = {model: min(index, COLOURS - 1) for index, model in enumerate(ranked)}
    legend = [(series[model], model) for model in ranked[: COLOURS - 1]]
    if len(ranked) >= COLOURS:
        legend.append((COLOURS - 1, "other models" if len(ranked) > COLOURS else ranked[-1]))

    peak = max((sum(_tokens(result) for result in bucket["results"]) for bucket in buckets), default=0)
    scale = (HEIGHT - TOP - BOTTOM) / peak if peak else 0.0
    slot = (WIDTH - LEFT - RIGHT) / max(len(buckets), 1)
    segments, days = [], []
    label_every = max(1, len(buckets) // 10)
    for index, bucket in enumerate(buckets):
        day = datetime.fromtimestamp(bucket["start_time"], timezone.utc).strftime("%b %d")
        x = LEFT + index * slot + slot * 0.15
        y = float(HEIGHT - BOTTOM)
        for result in sorted(bucket["results"], key=lambda result: series[result["model"]]):
            height = _tokens(result) * scale
            y -= height
            title = f"{day} · {result['model']}: {_tokens(result):,} tokens in {result['num_model_requests']:,} requests"
            segments.append(Segment(x, y, slot * 0.7, height, series[result["model"]], title))
        if index % label_every == 0:
            days.append((LEFT + (index + 0.5) * slot, day))
    ticks = [(HEIGHT - BOTTOM - peak * step / TICKS * scale, f"{round(peak * step / TICKS):,}") for step in range(1, TICKS + 1)]
    return Chart(segments, days, ticks if peak else [], legend, sum(by_model.values()))
