"""The documentation: every relative link and anchor of the README, docs/ and examples/ resolves, and every results
table is the one benchmarks/render.py writes from its record."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files() -> list[str]:
    files = ["README.md"]
    for top in ("docs", "examples"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            files += [os.path.relpath(os.path.join(folder, name), ROOT) for name in names if name.endswith(".md")]
    return sorted(files)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (the site uses the same: pymdownx.slugs.slugify(case="lower"))."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as file:
        lines = prose_lines(file.read())
    found, seen = set(), Counter()
    for line in lines:
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    for line in lines:  # footnotes and explicit anchors
        found.update(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", line))
    return found


def links(page: str) -> list[str]:
    with open(os.path.join(ROOT, page), encoding="utf-8") as file:
        lines = prose_lines(file.read())
    text = "\n".join(re.sub(r"`[^`]*`", "", line) for line in lines)  # not inside inline code
    return LINK.findall(text) + IMAGE.findall(text)


def broken_links(page: str) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(resolved):
            broken.append(f"{page}: {target} (no such file)")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            broken.append(f"{page}: {target} (no heading with that anchor in {os.path.relpath(resolved, ROOT)})")
    return broken


def test_github_slug_matches_githubs_anchors():
    assert github_slug("Stage 2 time and bfloat16 (issue 55)") == "stage-2-time-and-bfloat16-issue-55"
    assert github_slug("Heal: distil the dense model back (optional)") == "heal-distil-the-dense-model-back-optional"
    assert github_slug("`outlier_tokens`, clipped") == "outlier_tokens-clipped"
    assert github_slug("SmolLM2-135M, 25% (8 of 30 layers)") == "smollm2-135m-25-8-of-30-layers"


def test_the_link_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n\n## Part one\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#part-one) [gone](docs/b.md) [bad anchor](docs/a.md#part-two) [web](https://x.org/a)\n"
        "```\n[in code](docs/nothing.md)\n```\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, str(tmp_path)
    try:
        assert broken_links("README.md") == [
            "README.md: docs/b.md (no such file)",
            "README.md: docs/a.md#part-two (no heading with that anchor in docs/a.md)",
        ]
    finally:
        ROOT = saved


@pytest.mark.parametrize("page", markdown_files())
def test_every_relative_link_and_anchor_resolves(page):
    assert broken_links(page) == []


def load_render():
    spec = importlib.util.spec_from_file_location("render", os.path.join(ROOT, "benchmarks", "render.py"))
    render = importlib.util.module_from_spec(spec)
    sys.modules["render"] = render  # its dataclasses look their module up
    spec.loader.exec_module(render)
    return render


def test_render_rewrites_a_table_edited_by_hand():
    render = load_render()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as file:
        text = file.read()
    assert "<!-- render: readme-results -->" in text
    edited = text.replace("| SmolLM2-135M, 25% |", "| SmolLM2-135M, 25% typed by hand |", 1)
    assert edited != text
    assert render.render_text(edited, "README.md") == render.render_text(text, "README.md")
    assert render.render_text(edited, "README.md") != edited


def test_a_stale_chart_is_found_and_drawn_again(tmp_path, monkeypatch):
    """A chart is drawn from its records by the renderer: a chart file that differs from its drawing is reported, and
    the same records draw the same bytes."""
    render = load_render()
    assert {"deploy-chart", "layers-chart", "heal-chart"} <= set(render.CHARTS)
    name = "deploy-chart"
    alt, drawn = render.CHARTS[name]()
    assert drawn == render.CHARTS[name]()[1] and drawn.startswith("<svg") and "<title>" in drawn
    monkeypatch.setattr(render, "ROOT", str(tmp_path))
    for chart in render.CHARTS:  # every other chart as drawn, this one edited by hand
        path = tmp_path / render.CHART_FOLDER / f"{chart}.svg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render.CHARTS[chart]()[1].replace("#1f77b4", "#000000") if chart == name else render.CHARTS[chart]()[1])
    monkeypatch.setattr(render, "pages", lambda: [])
    assert list(render.differences()) == [f"{render.CHART_FOLDER}/{name}.svg"]
    assert render.main([]) == 0 and (tmp_path / render.CHART_FOLDER / f"{name}.svg").read_text() == drawn
    assert render.differences() == {}
    page = render.render_text("<!-- render: deploy-chart -->\n<!-- /render -->\n", "docs/benchmarks/deploy.md")
    assert f"![{alt}](charts/deploy-chart.svg)" in page


def test_the_readme_table_carries_no_footnotes_and_the_pages_it_links_carry_its_provenance():
    render = load_render()
    overview = importlib.import_module("rendering.overview")
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as file:
        block = file.read().split("<!-- render: readme-results -->")[1].split("<!-- /render -->")[0]
    assert "[^" not in block
    table = overview.readme_table(render.Context("README.md"))
    linked = sorted({target.partition("#")[0] for target in LINK.findall(block)})
    assert "docs/benchmarks/heal.md" in linked and "docs/benchmarks/stage1-cost.md" in linked
    pages = ""
    for page in linked:
        with open(os.path.join(ROOT, page), encoding="utf-8") as file:
            pages += file.read()
    # a page's footnote may say more (the Stage 1 cost page adds the load on the machine)
    assert table.notes and [note for note in table.notes if note.rstrip(".") not in pages] == []


def test_every_results_table_is_the_one_render_writes():
    changed = load_render().differences()
    assert not changed, (
        f"these pages' tables differ from their records' rendering: {sorted(changed)}; run `python benchmarks/render.py`"
    )
