"""The command line's edges: what an operator types that is wrong is refused before
anything starts, in one line naming the flag (exit 2), never with a traceback.

Nothing here starts Ray: `pdserve serve`'s start (preflight, the run) is replaced by a
trap that fails the test if it is reached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster import cli


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve serve` must refuse before it starts anything: reaching the start fails the test."""
    from pdserve.cluster import serve_app, shutdown

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pdserve serve started although its settings should have been refused")

    monkeypatch.setattr(serve_app, "preflight", started)
    monkeypatch.setattr(shutdown, "run_until_stopped", started)
    monkeypatch.setattr(shutdown, "serve_in_own_group", started)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`pdserve ARGV`'s stderr, once it has exited with status 2 (argparse's, and main's for a ValueError)."""
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        status = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2, f"exit status {status}, stderr: {err}"
    assert "Traceback" not in err
    return err


# -- --cluster-secret-file -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing", "a directory", "too short"])
def test_a_cluster_secret_file_that_cannot_be_used_is_refused_naming_the_flag(
        where: str, tmp_path: Path, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """It escaped main as a FileNotFoundError (IsADirectoryError) traceback, exit 1, or (too
    short) an error naming no flag; the two other key files (--api-key-file,
    --metrics-api-key-file) were one line naming the flag."""
    path = {"missing": tmp_path / "secret", "a directory": tmp_path, "too short": tmp_path / "short"}[where]
    if where == "too short":
        path.write_text("abc\n")
        path.chmod(0o600)
    err = refused(["serve", "--model", "/m", "--cluster-secret-file", str(path)], capsys)
    assert "cluster_secret_file" in err and str(path) in err and len(err.strip().splitlines()) == 1
