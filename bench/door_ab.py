"""Two versions of the front door side by side (issue 47): bench/door.py run in alternation,
A then B, `--pairs` times, and a table of every pair and the medians.

A and B are either another git revision and this checkout (`--against REF`: REF checked out
in a temporary worktree, which A's door.py runs from and imports pdserve from) or this checkout
under two environments (`--env-a K=V`, `--env-b K=V`, each repeatable: Ray's workers and the
gateway inherit them). One door run a side each pair, one replica count; on a machine whose
speed drifts over minutes only a difference that holds pair after pair is one (a single run
each way moved by +-2 us a token on the 2-core Xeon).

    python bench/door_ab.py --against HEAD~1 [--pairs 3] -- --concurrency 16 --tokens 64 --requests 960 --step-ms 5
    python bench/door_ab.py --env-a X=0 --env-b X=1 [--pairs 3] -- <door.py's flags>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from door import figures, fmt  # bench/ is on sys.path when run as a script
from machine import cpu_name

ROOT = Path(__file__).resolve().parents[1]
DOOR = Path("bench") / "door.py"  # relative to a side's tree
# The columns a pair's row shows (door.py's figures).
COLUMNS = ("gateway us/token", "haproxy us/token", "client us/token", "tokens/s", "tokens/chunk")
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Side:
    name: str  # what the table calls it
    tree: Path  # whose door.py runs, and whose pdserve it imports
    env: dict[str, str]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--against", help="A: this git revision (B: this checkout as it is, uncommitted edits too)")
    which.add_argument("--env-a", action="append", metavar="K=V", help="A: this checkout with K=V (repeatable)")
    p.add_argument("--env-b", action="append", default=[], metavar="K=V", help="B's environment, with --env-a")
    p.add_argument("--pairs", type=int, default=3, help="A and B runs, alternating (A first)")
    p.add_argument("--door", type=Path, default=DOOR, help=argparse.SUPPRESS)  # tests: a stand-in script
    p.add_argument("door_args", nargs=argparse.REMAINDER, help="door.py's flags, after --")
    a = p.parse_args(argv)
    if a.pairs < 1:
        p.error("--pairs: must be >= 1")
    if a.env_b and a.env_a is None:
        p.error("--env-b: only with --env-a")
    a.door_args = [x for x in a.door_args if x != "--"]
    for flag in ("--repeats", "--json"):
        if flag in a.door_args:
            p.error(f"{flag}: door_ab.py sets it (one run a side each pair)")
    if "--replicas" in a.door_args and "," in a.door_args[a.door_args.index("--replicas") + 1]:
        p.error("--replicas: one count (a pair compares one setting)")
    try:
        a.env_a_map, a.env_b_map = env_map(a.env_a or []), env_map(a.env_b)
    except ValueError as e:
        p.error(str(e))
    return a


def env_map(pairs: Sequence[str]) -> dict[str, str]:
    """{K: V} of `K=V` strings; a ValueError naming one without `=` or with an empty name."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"environment: {pair!r} is not K=V")
        out[key] = value
    return out


@contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """`rev` checked out (detached) in a temporary worktree of this repository, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="door-ab-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), rev],
                       check=True, timeout=120)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                           check=False, timeout=120)


def run_side(side: Side, door: Path, door_args: Sequence[str], out: Path) -> dict[str, Any]:
    """One door.py run of `side`: its first run's record (door.py's --json); SystemExit if it failed."""
    env = os.environ | side.env | {"PYTHONPATH": os.pathsep.join(
        [str(side.tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, str(side.tree / door), *door_args, "--repeats", "1", "--json", str(out)]
    print(f"[door-ab] {side.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=side.tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=RUN_TIMEOUT_S, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"[door-ab] {side.name}'s door run failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return dict(json.loads(out.read_text())["runs"][0])


def run_pairs(sides: tuple[Side, Side], door: Path, door_args: Sequence[str], pairs: int,
              tmp: Path) -> list[tuple[dict[str, float], dict[str, float]]]:
    """`pairs` x (A's figures, B's figures), each pair's runs back to back, A first."""
    out = []
    for i in range(pairs):
        a, b = (figures(run_side(s, door, door_args, tmp / f"{i}-{k}.json")) for k, s in enumerate(sides))
        print(f"[door-ab] pair {i + 1}/{pairs}: gateway {a['gateway us/token']:.1f} -> {b['gateway us/token']:.1f} "
              "us a token", file=sys.stderr, flush=True)
        out.append((a, b))
    return out


def table(names: tuple[str, str], results: Sequence[tuple[dict[str, float], dict[str, float]]]) -> str:
    """Each pair's row, then the medians' and B / A of the medians; the pairs in which B's gateway
    CPU a token was lower."""
    head = " | ".join(f"{n} {c}" for c in COLUMNS for n in names)
    lines = [f"| pair | {head} |", "|---:|" + "---:|" * (2 * len(COLUMNS))]

    def row(label: str, a: dict[str, float], b: dict[str, float]) -> str:
        return f"| {label} | " + " | ".join(fmt(c, side[c]) for c in COLUMNS for side in (a, b)) + " |"

    for i, (a, b) in enumerate(results, 1):
        lines.append(row(str(i), a, b))
    med = tuple({c: statistics.median(r[k][c] for r in results) for c in COLUMNS} for k in (0, 1))
    lines.append(row("median", med[0], med[1]))
    ratios = [cell for c in COLUMNS for cell in ("", f"{med[1][c] / med[0][c]:.3f}" if med[0][c] else "-")]
    lines.append("| B / A | " + " | ".join(ratios) + " |")
    lower = sum(b["gateway us/token"] < a["gateway us/token"] for a, b in results)
    lines.append(f"\nB's gateway CPU a token lower than A's in {lower} of {len(results)} pairs.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="door-ab-runs-") as tmp:
        if a.against is not None:
            with worktree(a.against) as tree:
                sides = (Side(a.against, tree, {}), Side("this checkout", ROOT, {}))
                results = run_pairs(sides, a.door, a.door_args, a.pairs, Path(tmp))
        else:
            sides = (Side(" ".join(a.env_a), ROOT, a.env_a_map), Side(" ".join(a.env_b) or "(no change)", ROOT,
                                                                    a.env_b_map))
            results = run_pairs(sides, a.door, a.door_args, a.pairs, Path(tmp))
    print(f"# the front door, A against B, {a.pairs} alternating pairs of one run each (A first)\n"
          f"command: python {' '.join(sys.argv)}\nmachine: {cpu_name()}, {os.cpu_count()} cores\n"
          f"A: {sides[0].name}\nB: {sides[1].name}\ndoor.py: {' '.join(a.door_args)}\n")
    print("CPU in us per streamed token per process group, as bench/door.py counts it:\n")
    print(table(("A", "B"), results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
