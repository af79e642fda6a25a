"""What every chaos scenario shares: the size of its load, when its fault strikes, and
the loads it runs (fresh probe prompts from the harness's set)."""

from __future__ import annotations

from chaos.harness import Fault, Harness, before_recovery
from chaos.load import Load, Outcome, Result

REQUESTS = 48  # per scenario's load
CONCURRENCY = 8
MAX_TOKENS = 128  # each probe's: streams long enough to be cut mid-way (~1 s at 8 concurrent)
AT_CHUNKS = 500  # the fault strikes once the load has streamed this many chunks (~1/10 of it)
AFTER = 8  # requests after recovery, all at once (both decode workers get some): all must be ok
# (o, p): by when `pdserve serve` has drained and exited on its own after its GCS's or raylet's loss
# (the drain's 10 s, the sweep's 3 s, on 2 cores); Ray itself ends everything at 60 s.
SELF_STOP_S = 30.0


def excuse_errors_before_recovery(r: Result, fault: Fault, recovered_at: float | None) -> bool:
    """The only worker of a role was down: a clean error (never a drop or a hang) is
    what a request in flight then, or sent before recovery, should get."""
    return r.outcome is Outcome.ERROR and before_recovery(r, fault, recovered_at)


def load_for(h: Harness, requests: int = REQUESTS, concurrency: int = CONCURRENCY, **kw: object) -> Load:
    return Load(h.probes, requests=requests, concurrency=concurrency, offset=h.take(requests), **kw)  # type: ignore[arg-type]


def decodes(h: Harness) -> list[str]:
    return h.server.opts.decode_names()


def prefills(h: Harness) -> list[str]:
    return h.server.opts.prefill_names()


LONG_USERS = ("b1", "b2", "g1")  # the scenarios on long prompts: each has its own REQUESTS of them


def long_load(h: Harness, key: str) -> Load:
    """Prompts of 600-1500 tokens (fresh ones for each scenario): their prefill and KV
    transfer take long enough to be struck."""
    probes = h.probe_set("long", REQUESTS * len(LONG_USERS), 32, (600, 1500))
    return Load(probes, requests=REQUESTS, concurrency=CONCURRENCY, offset=REQUESTS * LONG_USERS.index(key))
