"""A deterministic training corpus built from text already on the machine.

The tiny test models need a tokenizer trained on *something*, but tests and
CI cannot download data sets. The Python standard library sources are always
installed next to the interpreter, are plain UTF-8 text, and are large enough
(tens of MB) that a few MB of them train a sensible byte-level BPE.

Determinism matters because the corpus feeds a cache key: files are taken in
sorted relative-path order and cut at a byte budget, so the same interpreter
install always yields the same corpus, and `corpus_fingerprint` changes when
the install (and so the corpus) does.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

DEFAULT_CORPUS_BYTES = 4 * 1024 * 1024

# Directory names pruned anywhere in the tree. Test suites are huge and full of
# deliberately odd text; IDLE is GUI code; site-packages is whatever happens to
# be installed and would make the corpus differ between otherwise identical
# interpreters. (A module file called `test.py` is still taken.)
_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


def cache_dir() -> Path:
    """Root of pdserve's on-disk cache (trained tokenizers, tiny models).

    `$PDSERVE_CACHE_DIR` if set, else `$XDG_CACHE_HOME/pdserve`, else
    `~/.cache/pdserve`. Lives here, in the lowest module of `tiny`, so the
    tokenizer and builder modules can both use it without an import cycle;
    `builder.cache_dir` is the same function.
    """
    explicit = os.environ.get("PDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "pdserve"
    return Path.home() / ".cache" / "pdserve"


def stdlib_root() -> Path:
    """Directory holding the standard library's `.py` sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def _all_sources(root: Path) -> list[Path]:
    rels: list[str] = []
    # os.walk with in-place pruning rather than rglob: site-packages alone can
    # be 100+ MB of files we would only stat to throw away.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        rels.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    # Sort on the POSIX string, not the walk order (which is file-system
    # dependent), so the corpus is the same on every machine with this install.
    return [root / r for r in sorted(rels) if (root / r).is_file()]


def corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """Stdlib source files, in sorted relative-path order, up to `max_bytes` total.

    Whole files are taken while the running total of on-disk sizes stays
    within `max_bytes`; the first file that would overflow ends the list (so
    the cut is a pure function of the sorted file list). At least one file is
    returned, whatever the budget, so the corpus is never empty.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes: must be > 0, got {max_bytes}")
    root = stdlib_root()
    chosen: list[Path] = []
    total = 0
    for path in _all_sources(root):
        size = path.stat().st_size
        if chosen and total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise RuntimeError(f"corpus: no .py files found under {root}")
    return chosen


def iter_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> Iterator[str]:
    """Yield the corpus one file's text at a time (what BPE trainers consume)."""
    for path in corpus_files(max_bytes):
        # errors="replace": a stray non-UTF-8 byte must not break training.
        yield path.read_text(encoding="utf-8", errors="replace")


def corpus_text(max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """The whole corpus as one string (files joined by a newline)."""
    return "\n".join(iter_corpus(max_bytes))


def corpus_fingerprint(max_bytes: int = DEFAULT_CORPUS_BYTES) -> str:
    """sha256 hex digest over the chosen files' relative paths and sizes.

    Cheap (no file contents read) yet changes whenever the interpreter install
    or the byte budget changes the corpus, which is what a cache key needs.
    """
    root = stdlib_root()
    h = hashlib.sha256()
    h.update(f"max_bytes={max_bytes}\n".encode())
    for path in corpus_files(max_bytes):
        h.update(f"{path.relative_to(root).as_posix()}\t{path.stat().st_size}\n".encode())
    return h.hexdigest()
