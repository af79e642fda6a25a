"""One request's life on one process: its state, its deadline, and the one way out.

Every process a request passes through (the gateway, a prefill worker, a decode
worker, a colocated worker) holds one `Lifecycle` for it, and only one. The
states are the architecture's:

    QUEUED -> ROUTED -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED | ABORTED | FAILED

Each process walks the part that happens there (docs/lifecycle.md draws them):

    gateway            QUEUED -> ROUTED -> DECODING (first token seen) -> end
    colocated worker   QUEUED -> PREFILLING -> DECODING -> end
    prefill worker     QUEUED -> PREFILLING -> TRANSFERRING (KV in flight, blocks held) -> end
    decode worker      ROUTED (reserving) -> TRANSFERRING (blocks reserved, KV arriving) -> DECODING -> end
                       ROUTED | TRANSFERRING -> QUEUED (no room, or the KV failed: prefill here) -> ...
    any worker         PREFILLING | DECODING -> QUEUED (preempted: blocks freed, recomputed later) -> ...

In a worker the lifecycle is the request's only state: the engine's `Request`
carries it (`Request.life`) and the scheduler moves it as the request goes
through the engine's queues (workers/scheduler.py is the one place a worker
moves it); the worker's `AsyncEngine.end_now` ends it. The gateway moves its own.

`move` is the only place a state changes, and it refuses a move the machine does
not have. `end` is the only way out: it runs the request's exit hooks once, in
reverse order of registration (the resources they free were taken in order:
engine blocks, then a transfer registration, then a peer's share), whatever the
exit. Hooks must not raise and must not block: they post work, they do not wait
for it; one that raises is logged, and the others still run. A `Lifecycle`
is touched by one thread only (its owner's: a worker's engine thread).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

class RequestState(enum.Enum):
    QUEUED = "queued"  # admitted here, waiting for its turn (the gateway: for a route; a worker: for a step)
    ROUTED = "routed"  # the gateway sent it to its workers; a decode worker is reserving its blocks
    PREFILLING = "prefilling"  # its prompt is being computed here
    TRANSFERRING = "transferring"  # KV in flight prefill -> decode (held on one side, reserved on the other)
    DECODING = "decoding"  # generating tokens (the gateway: streaming them to the client)
    FINISHED = "finished"  # ended at a stop condition or its length limit
    ABORTED = "aborted"  # its caller ended it (the client went away, or a peer cancelled it)
    FAILED = "failed"  # an error ended it (deadline, a failed peer or transfer, bad input, the engine)

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED})
_S = RequestState
# The moves the machine has; any state may also end (see `Exit`).
# PREFILLING | DECODING -> QUEUED is a preemption (the request recomputes what it had).
NEXT: dict[RequestState, frozenset[RequestState]] = {
    _S.QUEUED: frozenset({_S.ROUTED, _S.PREFILLING}),
    _S.ROUTED: frozenset({_S.QUEUED, _S.TRANSFERRING, _S.DECODING}),
    _S.PREFILLING: frozenset({_S.TRANSFERRING, _S.DECODING, _S.QUEUED}),
    _S.TRANSFERRING: frozenset({_S.QUEUED, _S.DECODING}),
    _S.DECODING: frozenset({_S.QUEUED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
    _S.FAILED: frozenset(),
}


class Exit(enum.Enum):
    """Why a request left this process; each maps to a terminal state."""

    FINISHED = "finished"  # a stop condition or the length limit (prefill worker: its KV all sent)
    ABORTED = "aborted"  # the caller cancelled it (client gone, gateway or decode worker abort)
    DEADLINE = "deadline"  # its deadline passed here
    PEER_FAILED = "peer_failed"  # a worker or transfer it depended on failed, and nothing could recover it
    REJECTED = "rejected"  # bad input, refused before it started
    ENGINE_FAILED = "engine_failed"  # this worker's engine died
    FAULT = "fault"  # its own values or logits broke its row of a step: failed alone, the batch went on

    @property
    def state(self) -> RequestState:
        if self is Exit.FINISHED:
            return RequestState.FINISHED
        return RequestState.ABORTED if self is Exit.ABORTED else RequestState.FAILED


class LifecycleError(RuntimeError):
    """A move the state machine does not have: a bug, never a client's fault."""


@dataclass(eq=False)
class Lifecycle:
    """The state, deadline and exit hooks of one request in one process."""

    request_id: str
    deadline: float  # time.monotonic() by which it must be over here
    state: RequestState = RequestState.QUEUED
    exit: Exit | None = None
    history: list[RequestState] = field(default_factory=list)  # every state it has been in, in order
    _on_exit: list[Callable[[Exit], None]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.history.append(self.state)

    @classmethod
    def start(cls, request_id: str, timeout_s: float, state: RequestState = RequestState.QUEUED) -> Lifecycle:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        return cls(request_id, time.monotonic() + timeout_s, state)

    @property
    def ended(self) -> bool:
        return self.state.terminal

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it passed)."""
        return max(0.0, self.deadline - time.monotonic())

    def check_move(self, to: RequestState) -> None:
        """LifecycleError unless `move(to)` would be taken: for a caller that must take
        something (blocks) only if the move will follow."""
        if to not in NEXT[self.state]:
            raise LifecycleError(f"request {self.request_id}: no move {self.state.value} -> {to.value}")

    def move(self, to: RequestState) -> None:
        """Enter `to`, one of the moves the machine has from here (not an end: see `end`)."""
        self.check_move(to)
        self.state = to
        self.history.append(to)

    def advance(self, to: RequestState) -> None:
        """`move` if that is forward from here; nothing if the request is already there or ended."""
        if not self.ended and self.state is not to:
            self.move(to)

    def on_exit(self, hook: Callable[[Exit], None]) -> None:
        """Run `hook(exit)` when the request leaves this process, however it leaves."""
        if self.ended:
            raise LifecycleError(f"request {self.request_id}: exit hook added after it ended")
        self._on_exit.append(hook)

    def end(self, exit: Exit) -> bool:
        """Leave: enter `exit.state`, run the exit hooks (last added first). False if it
        had already ended (the first exit wins; later ones change nothing)."""
        if self.ended:
            return False
        self.exit, self.state = exit, exit.state
        self.history.append(exit.state)
        hooks, self._on_exit = self._on_exit, []
        for hook in reversed(hooks):
            try:
                hook(exit)
            except Exception:  # one resource that failed to free must not keep the others
                log.exception("request %s: an exit hook failed (%s)", self.request_id, exit.value)
        return True
