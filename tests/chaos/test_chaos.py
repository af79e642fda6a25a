"""The chaos suite's CI subset (issue 13): real `pdserve serve` processes killed under
streaming greedy load, on one server start (1 prefill + 2 decode workers, the tiny
model). bench/chaos.py runs the whole matrix; docs/reliability.md has its results.

- (a) a decode worker SIGKILLed mid-stream: its requests move to the other decode
  worker and finish with exactly the offline engine's greedy text;
- (e) a decode worker's engine thread crashes (injected): the worker exits, Ray
  restarts it, its requests move;
- (f) the only prefill worker SIGKILLed: handoffs recompute on their decode worker,
  new requests are prefilled there until it is back;
- (k) one request's row fails in every step on a decode worker (injected): that
  request alone ends with a clean error and is not moved; nothing restarts.

After each: 0 wrong, 0 hung, 0 lost, nothing held by any worker after the drain
(blocks, KV registrations, requests, tasks, threads), the pool back to size and
/health 200 "ok" within 1.5 x model load + 10 s, and requests after recovery all ok.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from factories import tiny_spec

from pdserve.workers.tiny.builder import TinyModelSpec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="the harness reads /proc")]

SUBSET = ("a", "e", "f", "k")


@pytest.fixture(scope="module")
def harness(make_model: Callable[[TinyModelSpec], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    from chaos.base import AFTER, MAX_TOKENS, REQUESTS
    from chaos.harness import Harness
    from chaos.load import ENDPOINTS, make_probes
    from chaos.scenarios import TWO_DECODE, WARM_UP, server_options

    # test_serve_ray's model (made once per session): the scenarios' MODEL_SPEC.
    model = str(make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05)))
    # Probes go to /v1/completions, /v1/chat/completions and /v1/responses in turn: each
    # endpoint's streams must move, end and be whole through every fault.
    probes = make_probes(model, WARM_UP + len(SUBSET) * (REQUESTS + AFTER), seed=1, max_tokens=MAX_TOKENS,
                         endpoints=ENDPOINTS)
    h = Harness.start(server_options(model, TWO_DECODE), tmp_path_factory.mktemp("chaos"), probes,
                      log=lambda line: print(line, flush=True))
    try:
        yield h
    finally:
        h.close()
        assert not h.server.pids(), f"processes of the server left: {h.server.pids()}"


def _check(harness: object, key: str) -> None:
    from chaos.harness import Harness
    from chaos.load import ENDPOINTS
    from chaos.scenarios import BY_KEY, table

    assert isinstance(harness, Harness)
    result = BY_KEY[key].run(harness)
    print(table([result]))
    if not result.passed:
        pytest.fail(f"{table([result])}\n" + "\n".join(result.notes), pytrace=False)
    [by_endpoint] = [n for n in result.notes if n.startswith("ok by endpoint")]
    print(by_endpoint)
    assert all(f"{e} 0/" not in by_endpoint and e in by_endpoint for e in ENDPOINTS), by_endpoint


def test_decode_worker_killed_mid_stream(harness: object) -> None:
    _check(harness, "a")


def test_engine_thread_crash(harness: object) -> None:
    _check(harness, "e")


def test_only_prefill_worker_killed(harness: object) -> None:
    _check(harness, "f")


def test_one_requests_bad_row_fails_it_alone(harness: object) -> None:
    _check(harness, "k")


def test_workers_restarted_after_the_kills_do_not_run_behind_the_control_plane(harness: object) -> None:
    """Local Ray's control plane is at nice 19 (cluster/background_priority.py); the workers Ray
    restarted in the scenarios above, the gateway and haproxy at this process's own nice value
    (nice is inherited at fork: what starts them must not be moved)."""
    from chaos.harness import Harness
    from chaos.procs import cmdline
    from pdserve.cluster.background_priority import DEFAULT_NICE, is_background, nice_of

    assert isinstance(harness, Harness)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nices = {pid: (cmdline(pid), nice) for pid, nice in nice_of(harness.server.pids()).items()}
    behind = {cmd.split()[0] for cmd, nice in nices.values() if is_background(cmd) and nice == max(base, DEFAULT_NICE)}
    assert any("gcs_server" in c for c in behind) and any("ServeController" in c for c in behind), nices
    serving = [(cmd, nice) for cmd, nice in nices.values()
               if cmd.startswith(("ray::DecodeService", "ray::PrefillService", "ray::ServeReplica"))
               or "haproxy -db" in cmd]
    assert len([c for c, _ in serving if c.startswith("ray::DecodeService")]) == 2, nices
    assert all(nice == base for _, nice in serving), serving
