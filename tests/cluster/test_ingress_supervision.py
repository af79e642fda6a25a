"""The HAProxy ingress supervised (cluster/ingress.py): `pdserve serve --model tiny`
(colocated: one worker, the quickest start) under streaming load, its HAProxy
SIGKILLed (the pid found below the server's own process, never by name): /health
answers 200 again within 10 s, the streams cut by the kill end, and no worker
holds any of their requests afterwards (the gateway saw each client go and
aborted it; blocks back to idle).

The server and everything below it are this test's, stopped by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.cluster.background_priority import descendants

sys.path.insert(0, str(Path(__file__).parents[1]))
from chaos.procs import alive, cmdline, free_port  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")]

STREAMS = 32
MAX_TOKENS = 1900  # `tiny` holds 2048 positions; at this machine's rate a stream runs well past the checks
HEALTH_BAR_S = 10.0  # issue 46: /health 200 again within 10 s of the kill
RAY_LOGS = "/tmp/ray/session_latest/logs"  # local Ray's, started by the server under test
IDLE_BAR_S = 15.0  # from the kill to every worker idle (the streams, run to the end, take far longer)
# Every stream's whole context (2048 positions, 16-token blocks) held at once, and some to spare: not
# the CPU default's 4 GiB (131,072 blocks of the tiny model's), whose touch at start-up took seconds.
POOL_BLOCKS = STREAMS * 2048 // 16 + 256


def _serve_command(ports: list[int]) -> list[str]:
    pdserve = Path(sys.executable).with_name("pdserve")
    return [str(pdserve), "serve", "--model", "tiny", "--port", str(ports[0]), "--haproxy-metrics-port",
            str(ports[1]), "--haproxy-stats-port", str(ports[2]), "--haproxy-fallback-port", str(ports[3]),
            "--dtype", "float32", "--mode", "colocated",  # one worker: the quickest start
            "--num-kv-blocks", str(POOL_BLOCKS)]


@contextlib.contextmanager
def serving(tmp: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    ports: set[int] = set()
    while len(ports) < 4:
        ports.add(free_port())
    order = sorted(ports)
    log = tmp / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(_serve_command(order), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=tmp, start_new_session=True)
    ours: set[int] = set()
    try:
        yield proc, f"http://127.0.0.1:{order[0]}", log
    finally:
        ours.update(descendants(proc.pid))
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)  # a clean stop (cluster/shutdown.py), bounded there
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(40)
        for pid in ours:  # what outlived the stop: this test's, by pid
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def health(url: str, timeout_s: float = 1.0) -> int | None:
    try:
        r = httpx.get(f"{url}/health", timeout=timeout_s, trust_env=False)
    except httpx.HTTPError:
        return None
    return r.status_code if r.status_code != 200 or r.json().get("status") == "ok" else None


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 360.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        # "serving" comes once HAProxy's guard is in (/health may answer 200 before)
        if health(url) == 200 and b"[pdserve] serving" in log.read_bytes():
            return
        time.sleep(0.5)
    raise AssertionError(f"not healthy within {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def worker_activity(url: str) -> dict[str, float] | None:
    """Requests running or waiting on every worker, KV usage, and the gateway's requests
    in flight, from /metrics (None when it does not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(f"{url}/metrics", timeout=5, trust_env=False)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    wanted = {"pdserve:num_requests_running", "pdserve:num_requests_waiting", "pdserve:kv_cache_usage_perc",
              "pdserve:num_requests_in_flight"}
    out = dict.fromkeys(wanted, 0.0)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name in wanted:
                out[s.name] += s.value
    return out


def diagnosis(log: Path, statuses: list[tuple[float, int | None]]) -> str:
    """What a failure needs to be read: /health's answers after the kill (seconds, status; None:
    no answer), the server's output, and Ray Serve's HAProxy manager and controller logs
    (the restarts and reloads, with their times; health checks left out)."""
    changes = [(round(t, 2), s) for i, (t, s) in enumerate(statuses) if i == 0 or s != statuses[i - 1][1]]
    parts = [f"/health after the kill (s, status): {changes}", "--- serve.log ---",
             log.read_text(errors="replace")[-4000:]]
    for path in sorted(Path(RAY_LOGS).glob("serve/*.log")):
        if path.name.startswith(("proxy_", "controller_")):
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if "ealthz" not in ln]
            parts += [f"--- {path.name} ---", "\n".join(lines[-40:])]
    return "\n".join(parts)


def haproxies(root: int, port: int) -> list[int]:
    """The HAProxy processes below `root` that serve this run (their config is in its directory)."""
    return [pid for pid in descendants(root) if (c := cmdline(pid).split()) and os.path.basename(c[0]) == "haproxy"
            and f"pdserve-haproxy-{port}/" in " ".join(c)]


class Stream:
    def __init__(self) -> None:
        self.chunks = 0
        self.first_at: float | None = None
        self.finished = False  # the server sent [DONE]


async def _stream(client: httpx.AsyncClient, url: str, i: int, s: Stream) -> None:
    body = {"model": "tiny", "prompt": f"def f{i}(x):\n", "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with contextlib.suppress(httpx.HTTPError):
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    s.finished = True
                elif line.startswith("data:"):
                    s.chunks += 1
                    s.first_at = s.first_at or time.monotonic()


def test_haproxy_sigkilled_under_load_is_back_within_10s_and_workers_go_idle(tmp_path: Path) -> None:
    with serving(tmp_path) as (proc, url, log):
        wait_healthy(proc, url, log)
        port = int(url.rsplit(":", 1)[1])
        before: list[int] = []  # found right before the kill: a reload replaces HAProxy's process

        statuses: list[tuple[float, int | None]] = []  # /health after the kill

        async def scenario() -> tuple[list[Stream], float, float | None, float]:
            streams = [Stream() for _ in range(STREAMS)]
            async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), trust_env=False,
                                         limits=httpx.Limits(max_connections=STREAMS + 4)) as client:
                tasks = [asyncio.create_task(_stream(client, url, i, s)) for i, s in enumerate(streams)]
                deadline = time.monotonic() + 120
                while any(s.chunks < 5 for s in streams):
                    assert time.monotonic() < deadline, [s.chunks for s in streams]
                    await asyncio.sleep(0.1)
                before.extend(haproxies(proc.pid, port))
                assert before, f"no HAProxy below pid {proc.pid}"
                killed_at = time.monotonic()
                for pid in before:
                    with contextlib.suppress(ProcessLookupError):  # one draining after a reload may just have ended
                        os.kill(pid, signal.SIGKILL)
                back_at: float | None = None
                while back_at is None and time.monotonic() - killed_at < 30:
                    status = await asyncio.to_thread(health, url)
                    statuses.append((time.monotonic() - killed_at, status))
                    if status == 200:
                        back_at = time.monotonic()
                    else:
                        await asyncio.sleep(0.1)
                await asyncio.wait_for(asyncio.gather(*tasks), 30)  # every cut stream ends
            return streams, killed_at, back_at, time.monotonic()

        streams, killed_at, back_at, _ = asyncio.run(scenario())
        assert back_at is not None and back_at - killed_at < HEALTH_BAR_S, (
            f"/health not 200 within {HEALTH_BAR_S} s of the kill: {None if back_at is None else back_at - killed_at}\n"
            + diagnosis(log, statuses))
        assert not any(alive(pid) for pid in before)
        assert haproxies(proc.pid, port), "no HAProxy again below the server"
        assert not any(s.finished for s in streams), "a stream cut by the kill ran to its end"

        # The rate the streams had: run to their end, they would still be going at IDLE_BAR_S.
        rate = min(s.chunks / (killed_at - s.first_at) for s in streams if s.first_at is not None)
        left_s = (MAX_TOKENS - max(s.chunks for s in streams)) / rate
        if left_s < 5.0:
            pytest.skip(f"this machine runs the streams out in {left_s:.0f} s: too fast to tell an abort from an end")
        # Idle well before the streams could have run out: aborted, not finished.
        bar_s = min(IDLE_BAR_S, 0.6 * left_s)
        deadline = killed_at + bar_s
        activity = worker_activity(url)
        while (activity is None or any(activity.values())) and time.monotonic() < deadline:
            time.sleep(0.2)
            activity = worker_activity(url)
        assert activity is not None and not any(activity.values()), (
            f"{bar_s:.0f} s after the kill the workers still hold the cut streams' requests: {activity} "
            f"(run to their end they would take {left_s:.0f} s more)")
        print(f"HAProxy SIGKILLed under {STREAMS} streams: /health 200 after {back_at - killed_at:.1f} s, workers idle "
              f"after {time.monotonic() - killed_at:.1f} s (the streams had {left_s:.0f} s left)")
        # And it serves again.
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4}, timeout=60,
                       trust_env=False)
        assert r.status_code == 200, r.text
