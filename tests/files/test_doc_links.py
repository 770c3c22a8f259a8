"""Every relative link in the project's Markdown reaches a file, and a section where it names one.

A link `[text](path)` or `[text](path#anchor)` from a Markdown file is read relative to that
file; `(#anchor)` names a section of the file itself. The path must exist (a file or a
folder), and an anchor into a Markdown file must be one of its headings' anchors, computed as
GitHub does (tests/support/markdown.py, as for test_design_citations.py). Links with a scheme
(`https:`, `mailto:`, …) are left alone. Sections move between the README and docs/ as the
README stays short; this is what finds a link left pointing at the old place.

Reads files only: no network, no build.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from tests.support.markdown import MD_LINK, ROOT, anchors, line_of, markdown_files, read

SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.I)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """`where: target: why` for each relative link of one Markdown file that does not resolve."""
    text = read(path)
    bad = []
    for m in MD_LINK.finditer(text):
        target = m.group(1)
        if not target or SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        points_at = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        where = f"{path.relative_to(root)}:{line_of(text, m.start())}: {target}"
        if not points_at.exists():
            bad.append(f"{where}: no such file")
        elif anchor and points_at.suffix == ".md" and unquote(anchor) not in anchors(read(points_at)):
            bad.append(f"{where}: {points_at.name} has no such section")
    return bad


def test_a_broken_link_is_found(tmp_path):
    """The check would catch each kind of bad link: a missing file, a missing section, a
    missing section of the file itself, and lets good ones and absolute URLs pass."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n## Two words\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n## Here\n"
        "[ok](docs/guide.md#two-words) [ok](#here) [ok](docs/) [ok](https://example.com/x.md#y)\n"
        "[bad](docs/gone.md) [bad](docs/guide.md#three-words) [bad](#there)\n",
        encoding="utf-8")
    found = broken_links(readme, tmp_path)
    assert [line.split(": ")[1] for line in found] == ["docs/gone.md", "docs/guide.md#three-words", "#there"], found


def test_every_relative_link_resolves():
    files = markdown_files()
    assert ROOT / "README.md" in files and any(p.parent.name == "docs" for p in files), files
    bad = [line for path in files for line in broken_links(path)]
    assert not bad, "Markdown links that lead nowhere:\n" + "\n".join(bad)
