"""mkdocs hooks: the pages link to the repository's code, records and benchmark pictures outside docs/, which GitHub
follows as they are. On the site, a picture outside docs/ is copied in (under `repository/`) and linked there, and
any other link that leaves docs/ becomes the repository path in code font: the strict build then fails only on what
is broken (tests/test_docs.py checks that every path outside docs/ exists)."""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.abspath(__file__))
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>(?:[^\]\[]|\[[^\]]*\])*)\]\((?P<target>[^)\s]+)\)")
PICTURES = (".png", ".svg", ".jpg")
_copied: set[str] = set()


def _outside_docs(page_path: str, target: str, docs_dir: str) -> str | None:
    """The repository path of `target` (linked from the page `page_path` of docs/) when it lies outside docs/."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        return None
    path = target.partition("#")[0]
    resolved = os.path.normpath(os.path.join(docs_dir, os.path.dirname(page_path), path))
    if resolved == docs_dir or resolved.startswith(docs_dir + os.sep):
        return None
    return os.path.relpath(resolved, ROOT)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = os.path.normpath(config["docs_dir"])

    def replace(match: re.Match) -> str:
        path = _outside_docs(page.file.src_path, match.group("target"), docs_dir)
        if path is None:
            return match.group(0)
        if match.group("bang") and path.endswith(PICTURES):
            copied = "repository/" + path
            _copied.add(path)
            relative = os.path.relpath(copied, os.path.dirname(page.file.src_path) or ".")
            return f"![{match.group('text')}]({relative})"
        return f"{match.group('text')} (`{path}`)" if match.group("text") != f"`{path}`" else f"`{path}`"

    return LINK.sub(replace, markdown)


def on_files(files, config):
    """Every picture of benchmarks/results, copied in under `repository/` (only those linked are used)."""
    folder = os.path.join(ROOT, "benchmarks", "results")
    for name in sorted(os.listdir(folder)):
        if name.endswith(PICTURES):
            files.append(File.generated(config, f"repository/benchmarks/results/{name}", abs_src_path=os.path.join(folder, name)))
    return files
