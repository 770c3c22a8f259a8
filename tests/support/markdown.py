"""The project's Markdown as GitHub renders it, as far as links and anchors go: which files there
are, their links, and the anchors of their headings (tests/files/test_design_citations.py and
tests/files/test_doc_links.py).

A heading's anchor is its text, lowercased, with everything but letters, marks, digits,
connector punctuation (`_`), `-` and spaces removed, each space a `-`, and `-1`, `-2`, … after
repeated headings.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Installed packages, build output, fuzzing inputs and run logs: not the project's own text.
SKIP_DIRS = {"target", "node_modules", ".venv", "__pycache__", ".git", ".run", "corpus", "artifacts",
             "regressions", "work", ".pytest_cache"}

MD_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")


def walk(top: Path):
    if not top.is_dir():
        return
    for path in sorted(top.iterdir()):
        if path.is_dir():
            if path.name not in SKIP_DIRS and not path.is_symlink():
                yield from walk(path)
        elif path.is_file():
            yield path


def markdown_files() -> list[Path]:
    return [p for p in walk(ROOT) if p.suffix == ".md"]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def heading_text(raw: str) -> str:
    """The text a Markdown heading renders, as far as an anchor depends on it."""
    text = re.sub(r"\s+#+\s*$", "", raw.strip())           # closing hashes
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                      # inline HTML
    text = text.replace("`", "")                             # code spans keep their content
    text = re.sub(r"(\*{1,3})(\S.*?\S|\S)\1", r"\2", text)   # *emphasis*, **strong**
    return text


def slug(text: str) -> str:
    kept = []
    for ch in text.lower():
        if ch in " -" or unicodedata.category(ch)[0] in "LMN" or unicodedata.category(ch) == "Pc":
            kept.append("-" if ch == " " else ch)
    return "".join(kept)


def headings(markdown: str) -> list[str]:
    """The ATX headings outside fenced code blocks."""
    found, fence = [], None
    for line in markdown.splitlines():
        stripped = line.lstrip()
        marker = re.match(r"(`{3,}|~{3,})", stripped)
        if marker and len(line) - len(stripped) < 4:
            if fence is None:
                fence = marker.group(1)
            elif stripped.startswith(fence[0] * len(fence)) and not stripped[len(fence):].strip(fence[0]).strip():
                fence = None
            continue
        if fence is None:
            m = re.match(r" {0,3}(#{1,6})[ \t]+(.*)$", line) or re.match(r" {0,3}(#{1,6})$", line)
            if m:
                found.append(heading_text(m.group(2) if m.lastindex and m.lastindex >= 2 else ""))
    return found


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for text in headings(markdown):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out
