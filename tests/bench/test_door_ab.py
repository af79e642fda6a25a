"""bench/door_ab.py: two versions of the door in alternation, A first, each side under its own
environment and tree, and a table whose medians and counts come from exactly those runs.
door.py itself is replaced by a stand-in that writes the record door.py's --json writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import door_ab  # noqa: E402 - bench/ is not a package

STAND_IN = '''
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--json") + 1]
with open(os.environ["DOOR_AB_LOG"], "a") as log:
    log.write(os.environ.get("SIDE", "-") + " " + os.environ["PYTHONPATH"].split(os.pathsep)[0] + " "
              + " ".join(args[:args.index("--json")]) + "\\n")
gw = float(os.environ["GW_US"]) * 1e-6 * 1000  # 1,000 tokens
cpu = {"gateway": gw, "haproxy": 0.01, "workers": 0.01, "client": 0.02, "ray+other": 0.0, "machine": 0.1}
run = {"replicas": 1, "gateway_processes": 1, "wall_s": 1.0, "tokens": 1000, "chunks": 1000, "cpu_s": cpu}
json.dump({"args": {}, "runs": [run]}, open(out, "w"))
'''


def test_env_sides_alternate_a_first_and_the_table_is_their_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    door = tmp_path / "door_stand_in.py"
    door.write_text(STAND_IN)
    log = tmp_path / "runs.log"
    monkeypatch.setenv("DOOR_AB_LOG", str(log))
    rc = door_ab.main(["--env-a", "SIDE=a", "--env-a", "GW_US=60", "--env-b", "SIDE=b", "--env-b", "GW_US=50",
                       "--pairs", "3", "--door", str(door), "--", "--concurrency", "4", "--tokens", "8"])
    assert rc == 0
    runs = log.read_text().splitlines()
    assert [r.split()[0] for r in runs] == ["a", "b"] * 3
    assert all(r.split()[1] == str(door_ab.ROOT) for r in runs)  # this checkout's pdserve first on the path
    assert all(r.split(" ", 2)[2] == "--concurrency 4 --tokens 8 --repeats 1" for r in runs)
    out = capsys.readouterr().out
    median = next(line for line in out.splitlines() if line.startswith("| median |"))
    assert median.split("|")[2:4] == [" 60.0 ", " 50.0 "]  # A's and B's gateway us a token
    ratio = next(line for line in out.splitlines() if line.startswith("| B / A |"))
    assert ratio.split("|")[3].strip() == f"{50 / 60:.3f}"
    assert "lower than A's in 3 of 3 pairs" in out


def test_a_failed_run_stops_the_comparison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    door = tmp_path / "door_stand_in.py"
    door.write_text("import sys; print('the gateway did not start'); sys.exit(3)")
    with pytest.raises(SystemExit, match="the gateway did not start"):
        door_ab.main(["--env-a", "X=1", "--pairs", "1", "--door", str(door)])


@pytest.mark.parametrize("argv", [
    ["--env-a", "X=1", "--", "--repeats", "3"],  # door_ab sets it
    ["--env-a", "X=1", "--", "--replicas", "1,2"],  # one setting a pair
    ["--env-a", "no-equals-sign"],
    ["--env-b", "X=1"],  # B's environment without A's
    ["--against", "HEAD", "--pairs", "0"],
])
def test_flags_it_cannot_honour_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        door_ab.parse_args(argv)
    assert e.value.code == 2


def test_a_revision_is_checked_out_apart_and_removed_after() -> None:
    head = subprocess.run(["git", "-C", str(door_ab.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    with door_ab.worktree("HEAD") as tree:
        assert (tree / "bench" / "door.py").is_file() and tree != door_ab.ROOT
        at = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        assert at.stdout == head.stdout
    assert not tree.exists()
    listed = subprocess.run(["git", "-C", str(door_ab.ROOT), "worktree", "list"], capture_output=True, text=True)
    assert str(tree) not in listed.stdout


def test_against_a_revision_a_runs_from_its_worktree_and_b_from_this_checkout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if subprocess.run(["git", "-C", str(door_ab.ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    door = tmp_path / "door_stand_in.py"
    door.write_text(STAND_IN)
    log = tmp_path / "runs.log"
    monkeypatch.setenv("DOOR_AB_LOG", str(log))
    monkeypatch.setenv("GW_US", "55")
    assert door_ab.main(["--against", "HEAD", "--pairs", "2", "--door", str(door)]) == 0
    trees = [line.split()[1] for line in log.read_text().splitlines()]
    assert trees[1::2] == [str(door_ab.ROOT)] * 2
    assert trees[0] == trees[2] != str(door_ab.ROOT) and not Path(trees[0]).exists()  # removed after
