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
        handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    return log
