"""bench/README.md is the suite's index: every script in bench/ and bench/experiments/ has a row
there (a script nobody can find is a lab notebook's page), every script a row names exists, and
so does every script path in the commands (a script moved to experiments/ takes its command along)."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
ROW = re.compile(r"^\| *([\w.-]+\.(?:py|sh)) *\|", re.M)
COMMAND_PATH = re.compile(r"(?<![\w/])bench/[\w/.-]*[\w-]\.(?:py|sh)\b")


def _scripts() -> set[str]:
    return {p.name for d in (BENCH, BENCH / "experiments") for p in d.iterdir() if p.suffix in (".py", ".sh")}


def test_every_script_has_a_line_and_every_line_a_script() -> None:
    readme = (BENCH / "README.md").read_text()
    rows = set(ROW.findall(readme))
    helpers = {name for name in _scripts() if name not in rows and f"{name} (" in readme}  # the helpers' paragraph
    assert _scripts() - rows - helpers == set(), "scripts bench/README.md does not list"
    assert rows - _scripts() == set(), "bench/README.md rows for scripts that are gone"


def test_every_command_names_a_script_that_is_there() -> None:
    named = COMMAND_PATH.findall((BENCH / "README.md").read_text())
    gone = sorted({p for p in named if not (BENCH.parent / p).exists()})
    assert not gone, f"bench/README.md runs scripts that are not there: {gone}"
