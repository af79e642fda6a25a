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
from pdserve.cluster.cli import build_parser


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


# -- one setting, one flag of its name ------------------------------------------------------


def serve_parser() -> Any:
    return build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]


def test_every_setting_is_a_flag_of_pdserve_serve_by_its_name() -> None:
    """README ("Flags"): the same settings, by the same names, make a Serve YAML's args. The YAML
    took `metrics_api_key` with no flag of that name (the one exception documented is
    `--no-prefix-caching`, YAML `enable_prefix_caching: false`)."""
    from pdserve.cluster.serve_config import ENGINE_SETTINGS, SERVE_SETTINGS

    options = {o for a in serve_parser()._actions for o in a.option_strings}
    missing = {name for name in ENGINE_SETTINGS | SERVE_SETTINGS.keys()
               if f"--{name.replace('_', '-')}" not in options} - {"enable_prefix_caching"}
    assert missing == set()


def test_metrics_api_key_on_the_command_line_is_the_key_and_is_never_printed(
        no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--metrics-api-key KEY` (as `--api-key KEY`, and the YAML's `metrics_api_key`) was taken by
    argparse's prefix matching for `--metrics-api-key-file KEY`: the key was read as a path, and
    the error printed it ("metrics_api_key_file: cannot read KEY: No such file or directory")."""
    key = "sk-metrics-0123456789"
    cfg = cli._serve_config(build_parser().parse_args(["serve", "--model", "/m", "--metrics-api-key", key]))
    assert cfg.metrics_api_key == key
    err = refused(["serve", "--model", "/m", "--metrics-api-key", key, "--metrics-api-key-file", "/nonexistent"],
                  capsys)
    assert "metrics_api_key" in err and key not in err
