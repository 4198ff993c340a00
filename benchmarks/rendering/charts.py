"""The pictures that open the results pages: scatter charts drawn from the records as plain SVG, by hand, so that the
same records always give the same bytes (no plotting library, no dates, no random ids) and `render.py --check` can
tell a stale chart like a stale table.

A chart is one or more panels side by side, each a scatter of points with a series (its colour) and a kind (its
marker), and one legend for all of them. Every point carries its label as a tooltip (`<title>`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 275, 240  # one panel, in pixels: two panels and the legend fit a results page's 688-pixel column
LEFT, RIGHT, TOP, BOTTOM = 56, 10, 26, 44
LEGEND = 135
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f")
MARKERS = ("circle", "square", "triangle", "diamond")


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    series: str  # the colour
    kind: str = ""  # the marker
    label: str = ""  # the tooltip


@dataclass(frozen=True)
class Panel:
    title: str
    x_label: str
    y_label: str
    points: Sequence[Point]
    log_x: bool = False
    log_y: bool = False
    y_from_zero: bool = True


@dataclass
class _Axis:
    low: float
    high: float
    log: bool = False
    ticks: list[float] = field(default_factory=list)

    @classmethod
    def over(cls, values: Sequence[float], log: bool, from_zero: bool) -> _Axis:
        low, high = min(values), max(values)
        if log:
            low, high = 10 ** math.floor(math.log10(low)), 10 ** math.ceil(math.log10(high))
            ticks = [10.0**power for power in range(round(math.log10(low)), round(math.log10(high)) + 1)]
            return cls(low, high, True, ticks)
        low = 0.0 if from_zero else low
        margin = (high - low) * 0.06 or abs(high) * 0.1 or 1.0
        low, high = (low if from_zero else low - margin), high + margin
        return cls(low, high, False, _ticks(low, high))

    def fraction(self, value: float) -> float:
        if self.log:
            return (math.log10(value) - math.log10(self.low)) / (math.log10(self.high) - math.log10(self.low))
        return (value - self.low) / (self.high - self.low)


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    step = 10 ** math.floor(math.log10((high - low) / count))
    for multiple in (1, 2, 5, 10):
        if (high - low) / (step * multiple) <= count:
            step *= multiple
            break
    first = math.ceil(low / step) * step
    return [round(first + index * step, 10) for index in range(int((high - first) / step + 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:g}"


def _marker(kind: str, x: float, y: float, colour: str) -> str:
    if kind == "square":
        return f'<rect x="{x - 3.5:.1f}" y="{y - 3.5:.1f}" width="7" height="7" fill="{colour}"/>'
    if kind == "triangle":
        return f'<path d="M{x:.1f},{y - 4.5:.1f} L{x + 4.5:.1f},{y + 3.5:.1f} L{x - 4.5:.1f},{y + 3.5:.1f} Z" fill="{colour}"/>'
    if kind == "diamond":
        corners = f"M{x:.1f},{y - 5:.1f} L{x + 4.5:.1f},{y:.1f} L{x:.1f},{y + 5:.1f} L{x - 4.5:.1f},{y:.1f} Z"
        return f'<path d="{corners}" fill="{colour}"/>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}"/>'


def _panel(left: float, panel: Panel, colours: dict[str, str], markers: dict[str, str]) -> list[str]:
    x_axis = _Axis.over([point.x for point in panel.points], panel.log_x, from_zero=False)
    y_axis = _Axis.over([point.y for point in panel.points], panel.log_y, panel.y_from_zero)
    inner_width, inner_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def at(point: Point) -> tuple[float, float]:
        return left + LEFT + x_axis.fraction(point.x) * inner_width, TOP + (1 - y_axis.fraction(point.y)) * inner_height

    out = [f'<text x="{left + LEFT}" y="16" font-weight="bold">{escape(panel.title)}</text>']
    for tick in y_axis.ticks:
        y = TOP + (1 - y_axis.fraction(tick)) * inner_height
        out.append(f'<line x1="{left + LEFT}" x2="{left + WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left + LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{_number(tick)}</text>')
    for tick in x_axis.ticks:
        x = left + LEFT + x_axis.fraction(tick) * inner_width
        out.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 14}" text-anchor="middle">{_number(tick)}</text>')
    out.append(f'<rect x="{left + LEFT}" y="{TOP}" width="{inner_width}" height="{inner_height}" fill="none" stroke="#999"/>')
    out.append(
        f'<text x="{left + LEFT + inner_width / 2:.0f}" y="{HEIGHT - 10}" text-anchor="middle">{escape(panel.x_label)}</text>'
    )
    out.append(
        f'<text transform="translate({left + 13},{TOP + inner_height / 2:.0f}) rotate(-90)" text-anchor="middle">'
        f"{escape(panel.y_label)}</text>"
    )
    for point in panel.points:
        x, y = at(point)
        marker = _marker(markers.get(point.kind, "circle"), x, y, colours[point.series])
        out.append(f"<g><title>{escape(point.label)}</title>{marker}</g>")
    return out


def scatter(panels: Sequence[Panel], title: str) -> str:
    """The SVG of `panels` side by side, with one legend: the series' colours, then the kinds' markers (where there
    are several kinds). `title` is the picture's accessible name."""
    points = [point for panel in panels for point in panel.points]
    colours = {series: COLOURS[index] for index, series in enumerate(dict.fromkeys(point.series for point in points))}
    kinds = [kind for kind in dict.fromkeys(point.kind for point in points) if kind]
    markers = {kind: MARKERS[index % len(MARKERS)] for index, kind in enumerate(kinds)}
    labels = [*colours, *(markers if len(markers) > 1 else [])]
    width = len(panels) * WIDTH + max(LEGEND, 24 + 7 * max(len(label) for label in labels))
    body = [line for index, panel in enumerate(panels) for line in _panel(index * WIDTH, panel, colours, markers)]
    entries = [(_marker("circle", 6, 0, colour), series) for series, colour in colours.items()]
    entries += [(_marker(marker, 6, 0, "#555"), kind) for kind, marker in markers.items()] if len(markers) > 1 else []
    for row, (marker, text) in enumerate(entries):
        body.append(f'<g transform="translate({len(panels) * WIDTH + 10},{TOP + 6 + 17 * row})">{marker}'
                    f'<text x="14" y="4">{escape(text)}</text></g>')  # fmt: skip
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{HEIGHT}" viewBox="0 0 {width} {HEIGHT}" '
            'font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="11" role="img">',
            f"<title>{escape(title)}</title>",
            *body,
            "</svg>",
            "",
        ]
    )
