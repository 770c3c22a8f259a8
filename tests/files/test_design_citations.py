"""Every citation of a section of docs/design.md names a section that exists.

Code cites the contract as `docs/design.md#<anchor>` (in comments and docstrings); the Markdown
documents link it as `[text](design.md#<anchor>)` from docs/ and `[text](docs/design.md#<anchor>)`
from the top, and docs/design.md links its own sections as `(#<anchor>)`. The anchors of
docs/design.md are computed from its headings the way GitHub renders them (tests/support/markdown.py):
the heading's text, lowercased, with everything but letters, marks, digits, connector punctuation
(`_`), `-` and spaces removed, each space a `-`, and `-1`, `-2`, … after repeated headings.

Reads files only: no network, no build.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.support.markdown import (
    MD_LINK,
    ROOT,
    anchors,
    heading_text,
    line_of,
    markdown_files,
    read,
    slug,
    walk,
)

DESIGN = ROOT / "docs" / "design.md"
THIS = Path(__file__).resolve()

# Where code lives, and what of it is text a comment can be in.
CODE_DIRS = ("src", "ledger", "protocol", "config", "tests", "scripts", "fuzz", "benches", "bench",
             "examples", "envoy")
CODE_SUFFIXES = {".rs", ".py", ".pml", ".sh", ".toml", ".yaml", ".yml", ".mjs", ".js", ".ts", ".go",
                 ".html", ".css", ".txt", ".lua", ".c", ".h"}
CODE_NAMES = {"Makefile", "Dockerfile", "with-postgres", "check.sh"}

CODE_CITATION = re.compile(r"docs/design\.md#([\w-]+)")
# The contract's old name, which no clone has. Spelled in two parts so this file does not cite it.
OLD_NAME = re.compile("DESIGN" + r"\.md")


def code_files() -> list[Path]:
    files = [ROOT / "Makefile"] if (ROOT / "Makefile").is_file() else []
    for name in CODE_DIRS:
        files += [p for p in walk(ROOT / name)
                  if (p.suffix in CODE_SUFFIXES or p.name in CODE_NAMES) and p.resolve() != THIS]
    return files


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
