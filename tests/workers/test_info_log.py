"""Where a served process's log lines go (workers/info_log.py)."""

from __future__ import annotations

import io
import logging
import logging.handlers
import sys
from collections.abc import Iterator

import pytest

from pdserve.workers.info_log import replica_logger

NAME = "pdserve.test_info_log"  # not the package's logger: the test leaves the process's logging as it was


@pytest.fixture
def served_process(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                   ) -> Iterator[tuple[logging.handlers.MemoryHandler, io.StringIO]]:
    """A Serve replica's logging: a root handler that holds records back (1,000 at a time) and
    sys.stderr swapped for a buffer."""
    held = logging.handlers.MemoryHandler(capacity=1000, flushLevel=logging.CRITICAL + 1)
    root = logging.getLogger()
    root.addHandler(held)
    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)  # (after capfd's own swap: the fixture asks for it first)
    try:
        yield held, swapped
    finally:
        root.removeHandler(held)
        log = logging.getLogger(NAME)
        for h in list(log.handlers):
            log.removeHandler(h)
        log.propagate, log.level = True, logging.NOTSET


def test_a_replicas_warnings_and_info_reach_its_own_stderr_at_once(
        served_process: tuple[logging.handlers.MemoryHandler, io.StringIO], capfd: pytest.CaptureFixture[str],
) -> None:
    held, swapped = served_process
    replica_logger(NAME)
    replica_logger(NAME)  # twice (a second replica in the process, a re-import): one line each still
    logging.getLogger(f"{NAME}.backend").warning("request %s: its worker failed (%s); moving it", "r1", "X")
    logging.getLogger(f"{NAME}.backend").info("worker w1: prefill -> decode")
    logging.getLogger(f"{NAME}.backend").debug("not this")
    err = capfd.readouterr().err
    assert err.count("request r1: its worker failed (X); moving it") == 1, err
    assert "WARNING" in err and f"{NAME}.backend" in err and "worker w1: prefill -> decode" in err
    assert "not this" not in err
    assert not held.buffer and not swapped.getvalue()
