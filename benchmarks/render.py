"""Renders the results tables of the README and of docs/ from the benchmarks' records (benchmarks/results/*.json).

    python benchmarks/render.py          # rewrites every table in place
    python benchmarks/render.py --check  # changes nothing; exit status 1 and a diff where a committed table differs

A table lives in a markdown file between two markers, `<!-- render: NAME -->` and `<!-- /render -->`; NAME is a key of
`TABLES`, whose function (in the module of benchmarks/rendering/ for that page) writes the table from its records. A
chart is the same: NAME is a key of a module's `CHARTS`, whose function draws it from the records as SVG
(`rendering.charts`) into docs/benchmarks/charts/NAME.svg, and the block holds the picture's link.
A paragraph whose figures come from the records (a results page's answer, the README's sentences on the results) is
the same: its function writes the whole paragraph, figures computed from the records (`rendering.common.paragraph`).
Nothing between the markers is typed by hand: the prose around them is. Every row carries a footnote with its
provenance (commit, date, command, machine, quiet or not, from benchmarks/provenance.py), a copied row says what it
copies, and a row measured by code older than a change of the library's behaviour that concerns it
(`rendering.common.CHANGES`) is marked with that change; a record written before rows carried their provenance says
so. The README's table carries no footnotes: its rows link to the pages that carry them. tests/test_docs.py fails
when a committed table or chart differs from what this script writes.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import pkgutil
import re
import sys
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `rendering`, whichever folder this runs from

import rendering  # noqa: E402
from rendering.common import ROOT, Context  # noqa: E402

MARKER = re.compile(r"(<!-- render: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /render -->)", re.DOTALL)


def tables() -> dict[str, Callable[[Context], str]]:
    """Every table's function: the `TABLES` of each module of benchmarks/rendering/ (one module per page)."""
    found: dict[str, Callable[[Context], str]] = {}
    for module in pkgutil.iter_modules(rendering.__path__):
        for name, function in getattr(importlib.import_module(f"rendering.{module.name}"), "TABLES", {}).items():
            if name in found:
                raise SystemExit(f"two tables named {name!r} in benchmarks/rendering/")
            found[name] = function
    return found


def charts() -> dict[str, Callable[[], tuple[str, str]]]:
    """Every chart's function, `() -> (its alt text, its SVG)`: the `CHARTS` of each module of benchmarks/rendering/."""
    found: dict[str, Callable[[], tuple[str, str]]] = {}
    for module in pkgutil.iter_modules(rendering.__path__):
        found.update(getattr(importlib.import_module(f"rendering.{module.name}"), "CHARTS", {}))
    return found


CHARTS = charts()
CHART_FOLDER = os.path.join("docs", "benchmarks", "charts")


def _chart_link(name: str) -> Callable[[Context], str]:
    def link(context: Context) -> str:
        alt, _ = CHARTS[name]()
        return f"![{alt}]({context.link(f'{CHART_FOLDER}/{name}.svg')})\n"

    return link


TABLES = {**tables(), **{name: _chart_link(name) for name in CHARTS}}


# --- writing ------------------------------------------------------------------------------------------------------


def pages() -> list[str]:
    """The README and every markdown page of docs/, as paths from the repository root."""
    found = ["README.md"]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        found += [os.path.relpath(os.path.join(folder, name), ROOT) for name in sorted(files) if name.endswith(".md")]
    return sorted(found)


def render_text(text: str, page: str) -> str:
    """`text` with every table between markers written anew."""

    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise SystemExit(f"{page}: no table named {name!r} in benchmarks/render.py (known: {', '.join(TABLES)})")
        return match.group(1) + TABLES[name](Context(page)) + match.group(4)

    return MARKER.sub(replace, text)


def differences() -> dict[str, tuple[str, str]]:
    """`{path: (committed text, rendered text)}` for every page whose tables differ from their rendering, and every
    chart whose file differs from its drawing (an empty text for a chart not written yet)."""
    changed = {}
    for name, draw in CHARTS.items():
        path = os.path.join(CHART_FOLDER, f"{name}.svg")
        committed = ""
        if os.path.exists(os.path.join(ROOT, path)):
            with open(os.path.join(ROOT, path), encoding="utf-8") as file:
                committed = file.read()
        drawn = draw()[1]
        if drawn != committed:
            changed[path] = (committed, drawn)
    for page in pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as file:
            text = file.read()
        rendered = render_text(text, page)
        if rendered != text:
            changed[page] = (text, rendered)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit status 1 where a table differs")
    args = parser.parse_args(argv)
    changed = differences()
    for page, (text, rendered) in changed.items():
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True), page, page))
        else:
            os.makedirs(os.path.dirname(os.path.join(ROOT, page)), exist_ok=True)
            with open(os.path.join(ROOT, page), "w", encoding="utf-8") as file:
                file.write(rendered)
            print(f"rendered {page}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
