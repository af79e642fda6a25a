"""The gateway's typed view of a worker actor's handle.

Ray's actor handles are untyped (mypy skips ray): a worker's method is called as
`handle.method.remote(*args)`, which returns an awaitable ObjectRef. These
Protocols name the methods the gateway calls (cluster/actors.py defines them),
their arguments and what they return, so that each call site is checked. A Ray
handle is taken for one as it is; a test's fake worker need only have the
methods its test calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from pdserve.cluster.ray_errors import RayActorError

if TYPE_CHECKING:
    from pdserve.cluster.reports import LoadReport, Progress, RoleSwitch, WorkerInfo
    from pdserve.cluster.router.policy import WorkerRole
    from pdserve.cluster.worker_inbox import Outcomes
    from pdserve.workers.handoff import FirstToken, PrefillOrder, ServeRequest
    from pdserve.workers.kv.event_log import EventCursor

P = ParamSpec("P")
R_co = TypeVar("R_co", covariant=True)


class RemoteMethod(Protocol[P, R_co]):
    """An actor method as a handle has it: `.remote(...)` sends the call; awaiting what
    it returns waits for the result (and raises the actor's error, or its death)."""

    def remote(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R_co]: ...


class WorkerHandle(Protocol):
    """Any worker: a colocated one (actors.EngineService) or a pool's (`PoolWorkerHandle`)."""

    @property
    def serve(self) -> RemoteMethod[[ServeRequest], None]:
        """Run the request here, its tokens on its `reply_to` stream."""
        ...

    @property
    def info(self) -> RemoteMethod[[], WorkerInfo]:
        """What it is: its KV blocks, its role, its inbox (where gateways start requests)."""
        ...

    @property
    def outcomes(self) -> RemoteMethod[[str, int, float], Outcomes]:
        """What became of the given gateway's tries there, reported after the report number
        given (a long poll: it waits up to the seconds given while none failed)."""
        ...

    @property
    def abort(self) -> RemoteMethod[[str, int], None]:
        """Drop try `attempt` of request `request_id` (fire and forget)."""
        ...

    @property
    def load(self) -> RemoteMethod[[EventCursor | None], LoadReport]:
        """Its load and its KV events from the cursor given (None: a snapshot of its
        prefix cache), the router's poll; reading consumes nothing."""
        ...

    @property
    def progress(self) -> RemoteMethod[[], Progress]:
        """Its engine snapshot and incarnation, without its prefix cache (the colocated stall watch's poll)."""
        ...

    @property
    def metrics(self) -> RemoteMethod[[], bytes]:
        """Its Prometheus exposition (merged into the gateway's /metrics)."""
        ...


class PrefillHandle(Protocol):
    """A prefill worker as a decode worker calls it in a handoff (actors.RayPrefillPeer)."""

    @property
    def prefill(self) -> RemoteMethod[[PrefillOrder], FirstToken]:
        """Compute the order's prompt into the decode worker's reserved blocks; its first token."""
        ...

    @property
    def abort(self) -> RemoteMethod[[str, int], None]:
        """Drop try `attempt` of request `request_id` (fire and forget)."""
        ...


class PoolWorkerHandle(WorkerHandle, PrefillHandle, Protocol):
    """A prefill or decode worker (actors.WorkerService): it also hands requests off, prefills
    for another worker's handoff, and changes role."""

    @property
    def handoff(self) -> RemoteMethod[[ServeRequest, PrefillHandle], None]:
        """Decode the request after the prefill worker given computes its prompt into blocks reserved here."""
        ...

    @property
    def meet(self) -> RemoteMethod[[str, PrefillHandle], None]:
        """Keep the prefill worker's handle under its name: a start on the inbox names it."""
        ...

    @property
    def switch_role(self) -> RemoteMethod[[WorkerRole, float], RoleSwitch]:
        """Drain for up to the timeout given, then become a worker of the role given."""
        ...


def abort_try(worker: WorkerHandle | PrefillHandle | None, request_id: str, attempt: int) -> None:
    """Tell a worker to drop try `attempt` of a request; fire and forget (a dead one is
    already rid of it; None: a worker not found, which holds nothing)."""
    if worker is not None:
        with contextlib.suppress(RayActorError):
            worker.abort.remote(request_id, attempt)
