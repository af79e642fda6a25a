"""The chaos harness's view of the cluster through Ray: a driver joined to the server's local
Ray (the GCS address is in the session directory of the server's `gcs_server`) that reads every
worker's `drain_state()` (its pid, what it still holds, its tasks and threads) and the gateway
replicas' ranks."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

from chaos.server import GATEWAY_DEPLOYMENT, NAMESPACE
from pdserve.cluster.reports import DrainState


class RayView:
    """A Ray driver on the server's local Ray: the workers' drain states, faults, infos."""

    def __init__(self, address: str) -> None:
        import ray
        import ray.cloudpickle

        self.ray, self.address = ray, address
        if ray.is_initialized():
            ray.shutdown()
        # This module is test tooling, which the workers cannot import: what it sends them to run
        # (`_thread_names`) travels by value, not as a reference to this module.
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        _token_auth()
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")

    def close(self) -> None:
        self.ray.shutdown()

    def handle(self, name: str) -> Any | None:
        try:
            return self.ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None

    def states(self, names: Iterable[str], timeout_s: float = 5.0) -> dict[str, DrainState | None]:
        """Each worker's drain_state(), or None for one that did not answer in time."""
        refs: dict[str, Any] = {}
        for name in names:
            h = self.handle(name)
            if h is not None:
                with contextlib.suppress(Exception):
                    refs[name] = h.drain_state.remote()
        out: dict[str, DrainState | None] = dict.fromkeys(names)
        deadline = time.monotonic() + timeout_s
        for name, ref in refs.items():
            try:
                out[name] = self.ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - dead, restarting, stopped: no answer
                with contextlib.suppress(Exception):
                    self.ray.cancel(ref)
        return out

    def thread_names(self, names: Iterable[str], timeout_s: float = 5.0) -> dict[str, list[str] | None]:
        """The names of each worker's threads (read in the worker, through Ray's
        `__ray_call__`), or None for one that did not answer."""
        refs: dict[str, Any] = {}
        for name in names:
            h = self.handle(name)
            if h is not None:
                with contextlib.suppress(Exception):
                    refs[name] = h.__ray_call__.remote(_thread_names)
        out: dict[str, list[str] | None] = dict.fromkeys(names)
        deadline = time.monotonic() + timeout_s
        for name, ref in refs.items():
            with contextlib.suppress(Exception):
                out[name] = self.ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
        return out

    def gateway_ranks(self, timeout_s: float = 10.0) -> dict[int, int]:
        """pid -> Serve replica rank of each gateway replica that answers (asked in the
        replica: the rank is what its responses' x-pdserve-replica says)."""
        refs = []
        for actor in self.ray.util.list_named_actors(all_namespaces=True):
            if f"#{GATEWAY_DEPLOYMENT}#" in actor["name"]:
                with contextlib.suppress(Exception):
                    h = self.ray.get_actor(actor["name"], namespace=actor["namespace"])
                    refs.append(h.__ray_call__.remote(_replica_rank))
        out: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s
        for ref in refs:
            try:
                pid, rank = self.ray.get(ref, timeout=max(0.01, deadline - time.monotonic()))
                out[pid] = rank
            except Exception:  # noqa: BLE001 - a replica dead or starting: not one that serves
                with contextlib.suppress(Exception):
                    self.ray.cancel(ref)
        return out

    def call(self, name: str, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        h = self.handle(name)
        if h is None:
            raise LookupError(f"no actor {name}")
        return self.ray.get(getattr(h, method).remote(*args), timeout=timeout_s)


def _thread_names(_actor: object) -> list[str]:
    """(Runs in the worker.) "name [class]" of each of its threads."""
    import threading

    return sorted(f"{t.name} [{type(t).__name__}]" for t in threading.enumerate())


def _replica_rank(_actor: object) -> tuple[int, int]:
    """(Runs in a gateway replica.) Its pid and its rank."""
    from pdserve.cluster.serve_app import replica_rank

    return os.getpid(), replica_rank()


def _token_auth() -> None:
    """Join with token authentication, as the server's local Ray has it (a new local
    Ray turns it on unless RAY_AUTH_MODE says otherwise; Server.start spells it out).
    Ray reads the mode when it is imported: set it the way ray.init does for a new
    local cluster (the variable, then Ray's config read again)."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        return  # turned off by the user: the server's Ray has it off too
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:  # another Ray: the variable alone
        os.environ["RAY_AUTH_MODE"] = "token"
        return
    _enable_token_auth()


def pid_of(state: DrainState | None) -> int | None:
    return int(state.incarnation.split("-")[0]) if state is not None else None


def born_at(state: DrainState) -> float:
    """When the worker process answering `state` finished starting (Unix time)."""
    return int(state.incarnation.split("-")[1]) / 1e9
