"""What the prefill and decode roles of a worker share: the engine and its thread."""

from __future__ import annotations

import abc
from typing import Self

from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.engine import LLMEngine


class RoleWorker(abc.ABC):
    """A role (prefill or decode) over one engine and the thread that steps it
    (`AsyncEngine`). A worker that changes role keeps both: it closes the old role's
    own resources (`close_role`) and hands the engine thread to the new one."""

    def __init__(self, engine: LLMEngine, async_engine: AsyncEngine | None, worker_id: str) -> None:
        self.engine = engine
        self.async_engine = async_engine or AsyncEngine(engine, worker_id=worker_id)

    def start(self) -> Self:
        """Start the engine thread (nothing if it runs already); returns self."""
        self.async_engine.start()
        return self

    def close(self) -> None:
        """Stop the engine thread (requests still here fail), then free the role's own."""
        self.async_engine.close()
        self.close_role()

    @abc.abstractmethod
    def close_role(self) -> None:
        """Free what this role holds of its own (threads, links, publishers), not the
        engine nor its thread. Bounded; may join threads: call it off the event loop."""

    def abort(self, request_id: str, attempt: int | None = None) -> None:
        """Cancel the request wherever it is here (with `attempt`: only that try or an
        earlier one); its exit hooks free what it holds. Does not wait; any thread."""
        self.async_engine.abort(request_id, attempt)
