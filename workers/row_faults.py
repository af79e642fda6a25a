"""Pinning a failed step on the rows that caused it.

A step runs every scheduled request's row together; one request's values (a
parameter that slipped past the checks, a token its logits cannot produce) can
make the whole step raise. Rather than let that end the engine thread and every
request on the worker, the engine runs each row of the failed step alone: the
rows that still fail are the requests' faults (each is failed alone, and not
migrated: it would only fail the next worker too), the others run on. A step
whose rows all succeed alone is the engine's fault, not a row's. When every row
fails alone (one bad request alone in its step, or two side by side), the
engine is asked to run a request of its own (`engine_runs`): if it cannot, the
fault is the engine's and the requests move on with the worker's restart; if it
can, the rows are the faults. More rows than MAX_JUDGED_ROWS all failing alone
are the engine's fault without asking.

Re-running a row is safe: a step writes each row's KV at slots the scheduler
gave it, so running it again writes the same values, and a seeded row's draws
depend on its seed and position only (sampler.seeded_at).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

Row = TypeVar("Row")

# Rows a failed step may have for all of them to be faults when each fails alone too (one
# bad request alone in its step, or two side by side), and then only if the engine runs a
# step of its own (`engine_runs`). More, all failing alone, is the engine's fault: its own
# step (one token at position 0) may pass where an engine broken for longer or bigger rows
# fails, and then every request of the batch would be failed instead of moved.
MAX_JUDGED_ROWS = 2

# Steps in a row in which every scheduled request was failed as a fault: past this, the
# engine is what is broken (a lost device, a corrupt cache), and it stops, so that
# supervision restarts the worker instead of it failing every request one by one.
MAX_FAULT_STREAK = 3


class NoRoomToCheck(Exception):
    """`engine_runs` could not run its step (no free KV block): it tells nothing."""


def isolate(run: Callable[[list[Row]], object], rows: Sequence[Row], error: Exception,
            engine_runs: Callable[[], object]) -> list[tuple[Row, Exception]]:
    """The rows of a step that failed with `error` that fail when run alone, each with
    its error. Re-raises `error` when it cannot be pinned on rows: none fails alone, or
    all do and there are more than MAX_JUDGED_ROWS of them, or `engine_runs()` (a step of
    the engine's own) raises too. Where the engine had no room for its step, one row alone
    is its own fault, two are the engine's (the rule before the engine checked itself)."""
    bad: list[tuple[Row, Exception]] = []
    if len(rows) == 1:  # it failed alone already
        bad.append((rows[0], error))
    else:
        for row in rows:
            try:
                run([row])
            except Exception as e:  # noqa: BLE001 - this row's fault, reported as its failure
                bad.append((row, e))
    if not bad:
        raise error
    if len(bad) == len(rows):
        if len(rows) > MAX_JUDGED_ROWS:
            raise error
        try:
            engine_runs()
        except NoRoomToCheck:
            if len(rows) > 1:
                raise error from None
        except Exception as broken:  # noqa: BLE001 - reported as the step's error, with this as its cause
            raise error from broken
    return bad


def describe(error: BaseException) -> str:
    """One line for the request's error: the exception's type and first line, cut short."""
    first = (str(error).splitlines() or [""])[0][:200]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
