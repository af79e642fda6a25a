"""Cache-aware, load-aware routing of requests to prefill and decode workers.

`index` keeps which blocks each worker caches (from KV events), `policy` holds
the pure decision functions, `router` composes them.
"""

from pdserve.cluster.router.index import PrefixIndex
from pdserve.cluster.router.policy import (
    DecodeReason,
    NoHealthyWorkerError,
    Plan,
    PrefillCost,
    RouterConfig,
    RouteReason,
    RouterSnapshot,
    RoutingDecision,
    RoutingPolicy,
    WorkerLoad,
    WorkerRole,
    choose_decode,
    choose_prefill,
    choose_round_robin,
    route,
)
from pdserve.cluster.router.router import Router, RouterStats

__all__ = [
    "DecodeReason", "NoHealthyWorkerError", "Plan", "PrefillCost", "PrefixIndex", "RouteReason",
    "Router", "RouterConfig", "RouterSnapshot", "RouterStats", "RoutingDecision", "RoutingPolicy",
    "WorkerLoad", "WorkerRole", "choose_decode", "choose_prefill", "choose_round_robin", "route",
]
