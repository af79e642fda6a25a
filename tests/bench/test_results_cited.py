"""bench/results/ holds the raw output behind the docs' figures and nothing else: every file there
is named by a doc (docs/*.md, README.md, bench/README.md), and every bench/results/ path a doc names
exists. Git history keeps every other run.

A doc names a file by its path (`bench/results/vs_vllm_tiny_zen5_2026-12-01.txt`), by a pattern
(`bench/results/profile_*_2026-11-27.json`, `bench/results/vs_vllm_{tiny,smollm2}_zen5_2026-12-01.txt`),
by a folder it lies in (`bench/results/disagg_vs_colocated/`), or by its bare file name after an
earlier path in the same paragraph, in that path's folder (`bench/results/a.txt, b.txt`;
`bench/results/gpu/x.txt and y.log` names gpu/y.log). Inline code and code blocks count: a command that reads
a results file names it too.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PREFIX = "bench/results/"
# A path under bench/results/: path characters, a glob's `*` and brace alternatives included; it
# ends in a name character or a `/` (so "bench/results/a.txt." and "(bench/results/a.txt)" give a.txt).
CITED = re.compile(r"bench/results/([\w.*{},/+-]*[\w*}/])")
BRACES = re.compile(r"\{([^{}]*)\}")


def docs() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "bench" / "README.md"]


def result_files() -> list[str]:
    """Every file under bench/results/, as a path relative to it (git ignores `*.tmp` there)."""
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p.suffix != ".tmp")


def expand(pattern: str) -> list[str]:
    """`a_{x,y}{1,2}.txt` -> a_x1.txt, a_x2.txt, a_y1.txt, a_y2.txt (as a shell expands braces)."""
    parts = BRACES.split(pattern)  # literal, alternatives, literal, alternatives, ..., literal
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def citations(text: str) -> list[str]:
    """The bench/results/ paths a text names, braces expanded (globs and folders as written)."""
    return [path for match in CITED.finditer(text) for path in expand(match.group(1))]


def matches(cited: str, files: list[str]) -> list[str]:
    """The files a cited path names: the file itself, a folder's files, or a glob's matches."""
    if "*" in cited:
        return [f for f in files if fnmatch.fnmatchcase(f, cited)]
    folder = cited.rstrip("/") + "/"
    return [f for f in files if f == cited or f.startswith(folder)]


BARE = re.compile(r"[\w.+-]+\.\w+")


def bare_names(text: str) -> set[str]:
    """The files a text names by bare name: each word that looks like a file name, after a full
    bench/results/ path in the same paragraph, taken in the folder of the nearest such path."""
    named = set()
    for paragraph in re.split(r"\n\s*\n", text):
        spans = [(m.end(), m.group(1)) for m in CITED.finditer(paragraph)]
        for word in BARE.finditer(paragraph):
            before = [path for end, path in spans if end <= word.start()]
            if before:
                folder = before[-1] if before[-1].endswith("/") else before[-1].rpartition("/")[0] + "/"
                named.add((folder + word.group()).lstrip("/"))
    return named


def test_every_result_file_is_cited_and_every_cited_path_exists() -> None:
    files = result_files()
    cited: set[str] = set()
    missing = []
    for doc in docs():
        text = doc.read_text(encoding="utf-8")
        for path in citations(text):
            found = matches(path, files)
            if not found:
                missing.append(f"{doc.relative_to(ROOT)}: {PREFIX}{path}")
            cited.update(found)
        cited.update(bare_names(text) & set(files))
    uncited = [PREFIX + f for f in files if f not in cited]
    assert not missing, "docs name bench/results/ paths that do not exist:\n" + "\n".join(missing)
    assert not uncited, ("files under bench/results/ that no doc names (delete them: git history keeps "
                         "them, or name them where their figure is):\n" + "\n".join(uncited))


def test_the_checker_reads_citations() -> None:
    text = ("raw: bench/results/a_{x,y}{1,2}.txt. See (bench/results/dir/) and `--profile "
            "bench/results/profile_*_2026.json`; bench/results/ holds them")
    assert citations(text) == ["a_x1.txt", "a_x2.txt", "a_y1.txt", "a_y2.txt", "dir/", "profile_*_2026.json"]
    files = ["a_x1.txt", "dir/p.png", "dir/sub/q.json", "profile_t_2026.json", "other.txt"]
    assert matches("dir/", files) == ["dir/p.png", "dir/sub/q.json"]
    assert matches("dir", files) == ["dir/p.png", "dir/sub/q.json"]
    assert matches("profile_*_2026.json", files) == ["profile_t_2026.json"]
    assert matches("a_x2.txt", files) == []
    assert "b_2026-12-01.txt" in bare_names("bench/results/a.txt, b_2026-12-01.txt.")
    # A bare name is taken in the folder of the path before it, in its paragraph only.
    assert "gpu/y.log" in bare_names("bench/results/gpu/x.txt and y.log")
    assert "y.log" not in bare_names("bench/results/gpu/x.txt and y.log")
    assert "c.txt" not in bare_names("c.txt, then bench/results/a.txt")
    assert "c.txt" not in bare_names("bench/results/a.txt\n\nc.txt")
