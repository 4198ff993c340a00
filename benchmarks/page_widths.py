"""How the results pages open in a browser 1,400 pixels wide: builds the documentation site, opens every page of
docs/benchmarks/ in headless Chromium at 1400 x 900, and for each page records whether it opens with a picture, the
lines of text between the picture and the first table, and, for every table, its width against the room it has
(a wider one scrolls sideways) and whether it starts on the opening screen. Saves a screenshot of each page's opening
screen beside the record.

    python benchmarks/page_widths.py --chromium chromium --mkdocs ../venv-docs/bin/mkdocs

Needs Chromium (`apt-get install chromium`) and the docs' extra (`pip install -e ".[docs]"`). Writes
benchmarks/results/page_widths.json and benchmarks/results/page_widths/<page>.png (not committed: the record says
what they show).
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import tempfile

import records
from common import RESULTS, ROOT, parser
from provenance import finish, provenance

SCREEN = (1400, 900)
MEASURE = r"""
<script>
window.addEventListener('load', function () {
  var out = {tables: [], images: []};
  var content = document.querySelector('.md-content__inner');
  document.querySelectorAll('.md-content img').forEach(function (image) {
    out.images.push({src: image.getAttribute('src'), top: Math.round(image.getBoundingClientRect().top + window.scrollY)});
  });
  document.querySelectorAll('.md-content table').forEach(function (table) {
    var wrap = table.closest('.md-typeset__scrollwrap') || table.parentElement;
    out.tables.push({columns: table.rows[0] ? table.rows[0].cells.length : 0, width: Math.round(table.scrollWidth),
      room: Math.round(wrap.clientWidth), scrolls: wrap.scrollWidth > wrap.clientWidth,
      top: Math.round(table.getBoundingClientRect().top + window.scrollY)});
  });
  var first = content.querySelector('table');
  var picture = content.querySelector('img');
  var lines = 0;
  if (first && picture) {  // the answer: the rendered lines of text between the picture and the first table
    var node = picture.closest('p');
    while ((node = node.nextElementSibling) && !node.contains(first) && !(node.querySelector && node.querySelector('table'))) {
      var style = getComputedStyle(node);
      lines += Math.round(node.getBoundingClientRect().height / parseFloat(style.lineHeight));
    }
  }
  out.answer_lines = lines;
  var pre = document.createElement('pre'); pre.id = 'MEASURE'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def chromium(binary: str, arguments: list[str], url: str) -> str:
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={SCREEN[0]},{SCREEN[1]}",
    ]
    return subprocess.run([*command, *arguments, url], capture_output=True, text=True, timeout=180, check=False).stdout


def measure(binary: str, site: str, page: str, shots: str) -> dict:
    """One page: its pictures, tables and answer lines, and a screenshot of its opening screen."""
    path = os.path.join(site, "benchmarks", page, "index.html")
    with open(path, encoding="utf-8") as file:
        text = file.read()
    probe = path.replace("index.html", "measure.html")
    with open(probe, "w", encoding="utf-8") as file:
        file.write(text.replace("</body>", MEASURE + "</body>"))
    dom = chromium(binary, ["--virtual-time-budget=3000", "--dump-dom"], f"file://{probe}")
    found = re.search(r'<pre id="MEASURE">(.*?)</pre>', dom, re.S)
    if not found:
        raise SystemExit(f"{page}: Chromium gave no measurement")
    figures = json.loads(html.unescape(found.group(1)))
    chromium(binary, ["--virtual-time-budget=3000", f"--screenshot={os.path.join(shots, page + '.png')}"], f"file://{path}")
    tables = figures["tables"]
    opening = [table for table in tables if table["top"] < SCREEN[1]]
    return {
        "page": f"docs/benchmarks/{page}.md",
        "opens_with_picture": bool(figures["images"]) and (not tables or figures["images"][0]["top"] < tables[0]["top"]),
        "answer_lines": figures["answer_lines"],
        "tables_on_opening_screen": len(opening),
        "opening_tables_scroll": any(table["scrolls"] for table in opening),
        "first_table": tables[0] if tables else None,
        "tables_that_scroll": sum(table["scrolls"] for table in tables),
        "tables": len(tables),
    }


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--chromium", default="chromium")
    arguments.add_argument("--mkdocs", default="mkdocs")
    args = arguments.parse_args()
    started = provenance()
    shots = os.path.join(RESULTS, "page_widths")
    os.makedirs(shots, exist_ok=True)
    with tempfile.TemporaryDirectory() as site:
        environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        subprocess.run([args.mkdocs, "build", "--quiet", "--site-dir", site], cwd=ROOT, check=True, env=environment)
        pages = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "docs", "benchmarks")) if name.endswith(".md"))
        rows = [measure(args.chromium, site, page, shots) for page in pages if page != "index"]
    for row in rows:
        first = row["first_table"] or {}
        print(
            f"{row['page']}: picture first {row['opens_with_picture']}, answer {row['answer_lines']} lines, first table "
            f"{first.get('columns')} columns {first.get('width')} px in {first.get('room')} px, opening screen scrolls "
            f"{row['opening_tables_scroll']}, {row['tables_that_scroll']} of {row['tables']} tables scroll"
        )
    records.write(
        os.path.join(RESULTS, "page_widths.json"),
        {"screen": list(SCREEN), "rows": rows, "provenance": finish(started)},
    )


if __name__ == "__main__":
    main()
