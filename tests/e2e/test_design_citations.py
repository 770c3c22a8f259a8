"""Every citation of a section of docs/design.md names a section that exists.

Code cites the contract as `docs/design.md#<anchor>` (in comments and docstrings); the Markdown
documents link it as `[text](design.md#<anchor>)` from docs/ and `[text](docs/design.md#<anchor>)`
from the top, and docs/design.md links its own sections as `(#<anchor>)`. The anchors of
docs/design.md are computed from its headings the way GitHub renders them: the heading's text,
lowercased, with everything but letters, marks, digits, connector punctuation (`_`), `-` and
spaces removed, each space a `-`, and `-1`, `-2`, … after repeated headings.

Reads files only: no network, no build.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
THIS = Path(__file__).resolve()

# Where code lives, and what of it is text a comment can be in.
CODE_DIRS = ("src", "ledger", "protocol", "config", "tests", "scripts", "fuzz", "benches", "bench",
             "examples", "envoy")
CODE_SUFFIXES = {".rs", ".py", ".pml", ".sh", ".toml", ".yaml", ".yml", ".mjs", ".js", ".ts", ".go",
                 ".html", ".css", ".txt", ".lua", ".c", ".h"}
CODE_NAMES = {"Makefile", "Dockerfile", "with-postgres", "check.sh"}
# Installed packages, build output, fuzzing inputs and run logs: not the project's own text.
SKIP_DIRS = {"target", "node_modules", ".venv", "__pycache__", ".git", ".run", "corpus", "artifacts",
             "regressions", "work", ".pytest_cache"}

CODE_CITATION = re.compile(r"docs/design\.md#([\w-]+)")
MD_LINK = re.compile(r"\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
# The contract's old name, which no clone has. Spelled in two parts so this file does not cite it.
OLD_NAME = re.compile("DESIGN" + r"\.md")


def _walk(top: Path):
    if not top.is_dir():
        return
    for path in sorted(top.iterdir()):
        if path.is_dir():
            if path.name not in SKIP_DIRS and not path.is_symlink():
                yield from _walk(path)
        elif path.is_file():
            yield path


def code_files() -> list[Path]:
    files = [ROOT / "Makefile"] if (ROOT / "Makefile").is_file() else []
    for name in CODE_DIRS:
        files += [p for p in _walk(ROOT / name)
                  if (p.suffix in CODE_SUFFIXES or p.name in CODE_NAMES) and p.resolve() != THIS]
    return files


def markdown_files() -> list[Path]:
    return [p for p in _walk(ROOT) if p.suffix == ".md"]


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


def design_anchors() -> set[str]:
    return anchors(read(DESIGN))


def code_citations() -> list[tuple[str, str]]:
    """(where, anchor) for every `docs/design.md#anchor` in the code."""
    found = []
    for path in code_files():
        text = read(path)
        for m in CODE_CITATION.finditer(text):
            found.append((f"{path.relative_to(ROOT)}:{line_of(text, m.start())}", m.group(1)))
    return found


def markdown_citations() -> list[tuple[str, str]]:
    """(where, anchor) for every Markdown link to a section of docs/design.md."""
    found = []
    for path in markdown_files():
        text = read(path)
        for m in MD_LINK.finditer(text):
            target = m.group(1)
            if "#" not in target or re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            file_part, anchor = target.split("#", 1)
            points_at = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
            if points_at == DESIGN.resolve():
                found.append((f"{path.relative_to(ROOT)}:{line_of(text, m.start())}", unquote(anchor)))
    return found


# --- The helpers themselves ---------------------------------------------------------------


@pytest.mark.parametrize("heading, anchor", [
    ("The decision table", "the-decision-table"),
    ("Envoy facts the filter relies on", "envoy-facts-the-filter-relies-on"),
    ("Agent pods: the proxy's UID and capabilities", "agent-pods-the-proxys-uid-and-capabilities"),
    ("`upstream_key.mode` and `request_hold`", "upstream_keymode-and-request_hold"),
    ("EnvoyFilter or [WasmPlugin](https://istio.io)", "envoyfilter-or-wasmplugin"),
    ("Rounds and capabilities: who may report", "rounds-and-capabilities-who-may-report"),
    ("Today's numbers", "todays-numbers"),
    ("CPU per call at 1 % of B (CPU-ms per request, per process)",
     "cpu-per-call-at-1--of-b-cpu-ms-per-request-per-process"),
    ("**Strong** words", "strong-words"),
])
def test_anchors_are_computed_as_github_does(heading, anchor):
    assert slug(heading_text(heading)) == anchor


def test_repeated_headings_and_code_blocks():
    text = "# A\n## B\n```sh\n# not a heading\n```\n## B\n~~~\n## also not\n~~~\n### B ###\n"
    assert anchors(text) == {"a", "b", "b-1", "b-2"}


def test_a_missing_section_is_found(tmp_path):
    """The check below would catch a bad citation: one made up here is not an anchor."""
    doc = tmp_path / "doc.md"
    doc.write_text("see [it](design.md#the-decision-tabel)\n", encoding="utf-8")
    links = [m.group(1) for m in MD_LINK.finditer(read(doc))]
    assert links == ["design.md#the-decision-tabel"]
    assert "the-decision-tabel" not in design_anchors()
    assert CODE_CITATION.findall("/// See docs/design.md#the-decision-tabel.") == ["the-decision-tabel"]


# --- The repository ------------------------------------------------------------------------


def test_the_contract_has_its_sections():
    have = design_anchors()
    for anchor in ("words", "attempt-states", "the-decision-table", "what-the-agent-sees",
                   "what-the-upstream-sees", "envoy-facts-the-filter-relies-on", "mcp-versions",
                   "trust-between-the-filter-and-the-ledger", "every-route-goes-through-the-filter",
                   "the-ledger"):
        assert anchor in have, f"docs/design.md has no section #{anchor}; it has {sorted(have)}"


@pytest.mark.parametrize("kind", ["code", "markdown"])
def test_every_citation_names_a_section(kind):
    citations = code_citations() if kind == "code" else markdown_citations()
    assert citations, f"no {kind} cites a section of docs/design.md: the scan found nothing, so it proves nothing"
    have = design_anchors()
    bad = [f"{where}: docs/design.md#{anchor}" for where, anchor in citations if anchor not in have]
    assert not bad, f"{kind} citing sections docs/design.md does not have:\n" + "\n".join(bad)


def test_no_code_cites_the_old_name():
    bad = []
    for path in code_files():
        text = read(path)
        bad += [f"{path.relative_to(ROOT)}:{line_of(text, m.start())}" for m in OLD_NAME.finditer(text)]
    assert not bad, "cite docs/design.md#<section> instead of a file no clone has:\n" + "\n".join(bad)
