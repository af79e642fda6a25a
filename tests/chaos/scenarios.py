"""The chaos scenarios of issue 13 (a)-(i), issue 46 (j)-(l) and issue 47 (m), each a
function of a running `Harness` (harness.py), and the matrix they make (bench/chaos.py
prints it; test_chaos.py runs the CI subset). The scenarios live by what they strike:
worker_faults.py, door_faults.py (the gateway and the ingress), link_faults.py and
server_faults.py (`pdserve serve` itself); base.py has what they share.

Every scenario runs streaming greedy load over fresh probe prompts, strikes a
process the harness started (by pid) once the load has streamed `AT_CHUNKS`
chunks, and is judged the same way (`ScenarioResult.judge`): 0 wrong, 0 hung,
0 lost while a survivor could serve, nothing held by any worker after the drain
(KV blocks, KV registrations, requests; tasks and threads back to each worker's
baseline), the pool back to size (a killed worker answering from a new process)
and /health 200 "ok" within 1.5 x model load + 10 s of the fault
(`recovery_budget`), and every request after recovery ok.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chaos.base import AFTER, MAX_TOKENS, REQUESTS
from chaos.door_faults import gateway_killed, ingress_killed, replica_killed
from chaos.harness import Harness, ScenarioResult
from chaos.link_faults import disconnect_burst, kv_link_cut, token_link_cut
from chaos.load import ENDPOINTS, make_probes
from chaos.server import COUNTERS, ServerOptions
from chaos.server_faults import control_plane_lost, server_killed
from chaos.worker_faults import (
    STOP_S,
    colocated_hung,
    decode_hung,
    decode_killed,
    decode_stopped,
    engine_crash,
    only_decode_killed,
    only_prefill_killed,
    prefill_killed_mid_prefill,
    prefill_killed_mid_transfer,
    row_poisoned,
    two_rows_poisoned,
)

# --- the matrix -----------------------------------------------------------------------------------

ONE_DECODE = "1p1d"
TWO_DECODE = "1p2d"
TWO_GATEWAYS = "1p2d2g"  # TWO_DECODE's workers behind two gateway replicas
TWO_COLOCATED = "2c"  # `--mode colocated`, two workers
OWN = "own"  # a server of its own (killed)


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    server: str  # which harness runs it: TWO_DECODE, TWO_GATEWAYS, ONE_DECODE, TWO_COLOCATED, OWN
    run: Callable[[Harness], ScenarioResult]
    probes: int = REQUESTS + AFTER  # of the harness's main set


SCENARIOS = [
    Scenario("a", "decode worker SIGKILL mid-stream", TWO_DECODE, decode_killed),
    Scenario("a1", "only decode worker SIGKILL (1P+1D)", ONE_DECODE, only_decode_killed),
    Scenario("b1", "prefill worker SIGKILL mid-prefill", TWO_DECODE, prefill_killed_mid_prefill, AFTER),
    Scenario("b2", "prefill worker SIGKILL mid-transfer", TWO_DECODE, prefill_killed_mid_transfer, AFTER),
    Scenario("c", "gateway replica SIGKILL", TWO_DECODE, gateway_killed),
    Scenario("l", "HAProxy ingress SIGKILL", TWO_DECODE, ingress_killed),
    Scenario("m", "one of two gateway replicas SIGKILL", TWO_GATEWAYS, replica_killed),
    Scenario("d", f"decode worker SIGSTOP {STOP_S:g} s + SIGCONT", TWO_DECODE, decode_stopped),
    Scenario("e", "decode engine-thread crash (injected)", TWO_DECODE, engine_crash),
    Scenario("f", "only prefill worker SIGKILL", TWO_DECODE, only_prefill_killed),
    Scenario("g1", "KV link cut mid-transfer (ss -K)", TWO_DECODE, kv_link_cut, AFTER),
    Scenario("g2", "token link cut mid-stream (ss -K)", TWO_DECODE, token_link_cut),
    Scenario("h", "disconnect burst + decode SIGKILL", TWO_DECODE, disconnect_burst),
    Scenario("i1", "pdserve serve SIGKILL, restarted", OWN, lambda h: server_killed(h, "SIGKILL")),
    Scenario("i2", "pdserve serve SIGTERM to its group, restarted", OWN, lambda h: server_killed(h, "SIGTERM")),
    Scenario("j", "decode worker SIGSTOP 60 s (hang)", TWO_DECODE, decode_hung),
    Scenario("o", "local Ray's GCS SIGKILL", OWN, lambda h: control_plane_lost(h, "gcs_server")),
    Scenario("p", "local Ray's raylet SIGKILL", OWN, lambda h: control_plane_lost(h, "raylet")),
    Scenario("k", "one request's row fails on a decode worker (injected)", TWO_DECODE, row_poisoned),
    Scenario("k2", "2 requests' rows fail on one decode worker (injected)", TWO_DECODE, two_rows_poisoned),
    Scenario("n", "colocated worker SIGSTOP 60 s (hang)", TWO_COLOCATED, colocated_hung),
]
BY_KEY = {s.key: s for s in SCENARIOS}

MODEL_SPEC = dict(arch="llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)
WARM_UP = 16


def server_options(model: str, which: str) -> ServerOptions:
    extra = ("--gateway-replicas", "2") if which == TWO_GATEWAYS else ()
    return ServerOptions(model, prefill=1, decode=1 if which == ONE_DECODE else 2, extra=extra,
                         colocated=2 if which == TWO_COLOCATED else 0)


def run_matrix(model: str, keys: list[str], log_dir: Path, log: Callable[[str], None] = print,
               on_result: Callable[[ScenarioResult], None] | None = None) -> list[ScenarioResult]:
    """Run the scenarios `keys` (in SCENARIOS order), one harness per server kind."""
    chosen = [s for s in SCENARIOS if s.key in keys]
    results: list[ScenarioResult] = []
    for which in (TWO_DECODE, TWO_GATEWAYS, ONE_DECODE, TWO_COLOCATED, OWN):
        group = [s for s in chosen if s.server == which]
        if not group:
            continue
        count = WARM_UP + sum(s.probes for s in group)
        log(f"[{which}] computing {count} probes' greedy answers offline ...")
        probes = make_probes(model, count, seed=len(results) + 1, max_tokens=MAX_TOKENS, endpoints=ENDPOINTS)
        for s in group if which == OWN else [None]:
            opts = server_options(model, which if which != OWN else TWO_DECODE)
            sub = log_dir / (which if s is None else f"own-{s.key}")
            pools = f"{opts.colocated} colocated" if opts.colocated else f"{opts.prefill}P+{opts.decode}D"
            log(f"[{which}] starting pdserve serve ({' '.join([pools, *opts.extra])}) ...")
            h = Harness.start(opts, sub, probes, log=log)
            try:
                for sc in group if s is None else [s]:
                    log(f"[{sc.key}] {sc.title} ...")
                    try:
                        r = sc.run(h)
                    except Exception as e:  # noqa: BLE001 - one scenario's harness failure is its row's
                        r = ScenarioResult(sc.key, sc.title, failures=[f"harness error: {type(e).__name__}: {e}"])
                    results.append(r)
                    log(f"[{sc.key}] {'PASS' if r.passed else 'SKIP' if r.skipped else 'FAIL'} "
                        f"({r.elapsed_s:.0f} s) {'; '.join(r.failures)}")
                    if on_result is not None:
                        on_result(r)
            finally:
                h.close()
    order = {s.key: i for i, s in enumerate(SCENARIOS)}
    return sorted(results, key=lambda r: order[r.key])


def table(results: list[ScenarioResult]) -> str:
    """The matrix as a Markdown table."""
    rows = ["| scenario | requests | ok | clean errors | dropped | wrong | hung | lost | migrated | leaked blocks/"
            "regs/tasks/threads | recovery s (budget) | after recovery | result |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rec = "—" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        budget = "" if r.budget_s is None else f" ({r.budget_s:.1f})"
        migrated = int(r.counters.get("pdserve:request_migrations", 0)) if r.counters else "—"
        verdict = f"skipped: {r.skipped}" if r.skipped else "pass" if r.passed else "FAIL: " + "; ".join(r.failures)
        rows.append(f"| ({r.key}) {r.title} | {r.requests} | {r.ok} | {r.errors} | {r.dropped} | {r.wrong} | "
                    f"{r.hung} | {r.lost} | {migrated} | {r.leaks.short()} | {rec}{budget} | "
                    f"{r.after_ok}/{r.after_total} | {verdict} |")
    return "\n".join(rows)


def counters_line(r: ScenarioResult) -> str:
    """The cluster's own counts of what it did (the non-zero COUNTERS)."""
    return ", ".join(f"{COUNTERS[n]} {v:g}" for n, v in r.counters.items() if v) or "nothing counted"
