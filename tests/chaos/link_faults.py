"""The chaos scenarios that cut links: the KV link mid-transfer ((g1)), the token link
mid-stream ((g2)), and a burst of client disconnects with a decode kill ((h))."""

from __future__ import annotations

import asyncio
import time

from chaos.base import AT_CHUNKS, REQUESTS, decodes, load_for, long_load, prefills
from chaos.harness import Check, Fault, Harness, ScenarioResult
from chaos.load import Load
from chaos.procs import can_cut_links, cut_links, links, loopback_ports
from chaos.ray_view import pid_of
from pdserve.cluster.reports import DrainState

# --- (g) a link cut mid-transfer ---------------------------------------------------------------

CUTS = 5


def _cut_some(what: str, cut: list[int]) -> Check:
    """A link-cut scenario's check: `cut` (the fault's count of connections it cut, once it has
    run) must be above 0; with nothing cut, nothing was struck and the load's verdict proves nothing."""
    def check(res: ScenarioResult, _b: dict[str, DrainState | None], _a: dict[str, DrainState | None]) -> None:
        if not sum(cut):
            res.failures.append(f"no {what} connection was cut: the fault struck nothing")

    return check


def kv_link_cut(h: Harness) -> ScenarioResult:
    """Long prompts; each time a decode worker awaits KV, the TCP connections of the
    prefill worker's KV link to it are destroyed under both ends (`ss -K`), up to
    CUTS times: the transfer in flight is lost with its socket, ZeroMQ reconnects, the
    link resyncs; the decode worker's request recomputes (or its KV arrives anyway)."""
    if not can_cut_links():
        return ScenarioResult("g1", "KV link cut mid-transfer", skipped="needs root for ss -K")

    struck: list[int] = []

    def fault(_: Load) -> Fault:
        t, cut, hit = time.monotonic(), 0, 0
        prefill = pid_of(h.view.states(prefills(h))[prefills(h)[0]])
        for _try in range(CUTS):
            seen = h.wait_for(decodes(h), lambda s: s.kv_registrations > 0, timeout_s=3.0, poll_s=0.005)
            if seen is None or prefill is None:
                continue
            decode = pid_of(seen[1])
            assert decode is not None
            conns = links(prefill, decode, loopback_ports(decode))
            n = cut_links(conns)
            cut += n
            hit += bool(n)
            time.sleep(0.3)
        struck.append(cut)
        return Fault("ss -K (KV link)", "prefill -> decode", prefill, t, time.monotonic(),
                     f"{cut} connections cut in {hit} of {CUTS} tries, each with KV awaited")

    return h.run_fault("g1", "KV link cut mid-transfer (ss -K)", fault, long_load(h, "g1"), 20,
                       check=_cut_some("KV link", struck))


def token_link_cut(h: Harness) -> ScenarioResult:
    """Mid-stream, the decode workers' token-stream connections to the gateway are
    destroyed (`ss -K`) 3 times, 0.5 s apart: batches in the cut sockets are lost; the
    gateway sees the gap in the worker's numbering and moves the request on."""
    if not can_cut_links():
        return ScenarioResult("g2", "token link cut mid-stream", skipped="needs root for ss -K")

    struck: list[int] = []

    def fault(_: Load) -> Fault:
        t, cut = time.monotonic(), 0
        gateway = h.server.gateway_pid()
        states = h.view.states(decodes(h))
        for _round in range(3):
            for s in states.values():
                decode = pid_of(s)
                if decode is not None and gateway is not None:
                    cut += cut_links(links(decode, gateway))
            time.sleep(0.5)
        struck.append(cut)
        return Fault("ss -K (token link)", "decode -> gateway", gateway, t, time.monotonic(),
                     f"{cut} connections cut")

    return h.run_fault("g2", "token link cut mid-stream (ss -K)", fault, load_for(h), AT_CHUNKS,
                       check=_cut_some("token link", struck))


# --- (h) a kill during a burst of client disconnects ---------------------------------------------


def disconnect_burst(h: Harness) -> ScenarioResult:
    """16 streams; at the fault, half of them hang up at once and the busiest decode
    worker is SIGKILLed. The other half must complete exactly; nothing may be left."""
    def fault(load: Load) -> Fault:
        seen = h.wait_for(decodes(h), lambda s: s.jobs >= 4, timeout_s=5.0)
        name, state = seen if seen is not None else h.busiest(decodes(h))
        load.hang_up_now()
        f = h.kill_worker(name, state=state)
        f.what = "disconnect burst + SIGKILL"
        return f

    load = load_for(h, requests=REQUESTS, concurrency=16, hang_up_if=lambda i: i % 2 == 0, hang_up=asyncio.Event())

    def closed(res: ScenarioResult, _b: dict[str, DrainState | None], _a: dict[str, DrainState | None]) -> None:
        res.notes.append(f"{res.closed} streams hung up by their clients")
        if res.closed < 4:
            res.failures.append(f"only {res.closed} clients hung up: no burst")

    return h.run_fault("h", "disconnect burst + decode SIGKILL", fault, load, AT_CHUNKS, restarted=True,
                       check=closed, migrate=True)
