"""A logger whose INFO lines come out in a served process: the operator's log lines (a worker's stats
line, the gateway's request log), which logging's defaults would drop.

Why: a Ray worker or Serve replica sets up no logging of its own, so the root logger sits at WARNING
with no handler and an INFO line goes nowhere. Its stderr goes to its log file and, with Ray's
log_to_driver, to the `pdserve serve` console: where vLLM's users read these lines. (A Serve replica
also sends what it writes to sys.stderr to its Serve log file, buffered 1,000 records at a time.)
"""

from __future__ import annotations

import logging
import sys


def info_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)`, at INFO unless a level was set, with a stderr handler of its own
    unless the process has handlers (then it goes to them, as any logger's lines do)."""
    log = logging.getLogger(name)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers and not logging.getLogger().handlers:
        # The process's own stderr: a Serve replica swaps sys.stderr for a logger that buffers 1,000
        # records before it writes its file, and Ray forwards only the real one to the console.
        log.addHandler(_own_stderr("%(asctime)s %(levelname)s %(message)s"))
        log.propagate = False
    return log


class _OwnStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """The process's own stderr (its fd 2), whatever sys.stderr has been swapped for."""


def _own_stderr(fmt: str) -> _OwnStderr:
    handler = _OwnStderr(sys.__stderr__ or sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    return handler


def replica_logger(name: str = "pdserve") -> logging.Logger:
    """`name`'s lines, INFO and up, straight to the process's own stderr, whatever the process
    set up: in a Serve replica the root logger's handler and sys.stderr both hold records back
    (1,000 at a time, and a replica killed loses them), so the gateway's warnings and errors (a
    request moved, a request's error logged under the id its client was given) were never seen.
    Ray keeps that stderr in the replica's log file and shows it on the `pdserve serve` console."""
    log = logging.getLogger(name)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not any(isinstance(h, _OwnStderr) for h in log.handlers):
        log.addHandler(_own_stderr("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.propagate = False  # (the root's handler would hold a second copy back)
    return log
