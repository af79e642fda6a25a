"""Every relative Markdown link in docs/ and the READMEs names a file or folder that exists, and
so does every file of the repository they name in plain text (`docs/engine.md`,
`workers/scheduler.py`, `bench/chaos.py`): a file that moved leaves no stale name behind.

Links to the web (`http:`, `https:`, `mailto:`) and in-page anchors (`#section`) are not
checked; a link's own anchor (`cluster.md#routing`) is dropped before the file is looked up.
Fenced code blocks and inline code are skipped for links: what they hold is not a link.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "bench" / "README.md",
                                               ROOT / "deploy" / "README.md"]

# [text](target) and [text](target "title"); images (![alt](target)) too.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
EXTERNAL = ("http:", "https:", "mailto:", "ftp:")
# A file named in prose, by its path from the repository root (a glob's `*` stops the match).
DOC_MENTION = re.compile(r"(?<![\w/.*-])((?:docs|cluster|workers|kernels|bench|tests|deploy)/[\w./-]*[\w-]"
                         r"\.(?:md|py|sh|yaml|toml|json))(?![\w*])")


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link in `path`, outside code."""
    found = []
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match.group(1)
            if target.startswith(EXTERNAL) or target.startswith("#"):
                continue
            found.append((number, target))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for number, target in relative_links(doc):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not (doc.parent / file_part).exists():
            broken.append(f"{doc.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_named_in_prose_exist(doc: Path) -> None:
    missing = [f"{doc.relative_to(ROOT)}:{number}: {match.group(1)}"
               for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1)
               for match in DOC_MENTION.finditer(line)
               if not (ROOT / match.group(1)).exists()]
    assert not missing, "docs named that do not exist:\n" + "\n".join(missing)


def test_the_checker_sees_links(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("see [b](b.md#part), [web](https://example.com), [here](#x)\n"
                   "`[not](code.md)`\n```\n[nor](fenced.md)\n```\n![img](pic.png \"title\")\n",
                   encoding="utf-8")
    assert relative_links(doc) == [(1, "b.md#part"), (6, "pic.png")]
    named = [m.group(1) for m in DOC_MENTION.finditer(
        "docs/a.md, `workers/x/y.py`; tests/k/test_*.py, cluster/router/policy.route, bench/results/x.json.")]
    assert named == ["docs/a.md", "workers/x/y.py", "bench/results/x.json"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_over_600_lines(doc: Path) -> None:
    """A reference doc says how the system is; a longer one has turned into a diary (issue 45)."""
    lines = len(doc.read_text(encoding="utf-8").splitlines())
    assert lines <= 600, f"{doc.relative_to(ROOT)}: {lines} lines (at most 600: move the narrative to commit messages)"
