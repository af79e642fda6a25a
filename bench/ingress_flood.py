"""/health's latency while a running `pdserve serve` is flooded with idle sockets and
slow-body connections (issue 46: 4,200 idle plus 520 slow bodies, median under 1 s).

The flood: `--idle` connections that send nothing, and `--slow` that send a POST's
headers with a large Content-Length and then one body byte every `--drip-s`. Both
are what a slowloris client does; each one the server closes (HAProxy's header
timeout: 408) is opened again at once, so the count holds for the whole window.
They come from `--sources` loopback addresses (127.0.0.2, 127.0.0.3, ...), as
from that many clients: at the default 40 each holds ~118, under the per-client
cap (`--max-connections-per-client`, 256), so the global cap and the timeouts are
what is measured; `--sources 1` shows the per-client cap refusing the flood.

The probe: GET /health from 127.0.0.1 on a new connection every `--interval-s`
(as a load balancer checks) once the flood is up, for `--duration-s`; a probe with
no answer in `--probe-timeout-s` counts as that long, and as failed.

    python bench/ingress_flood.py --url http://127.0.0.1:8000 [--idle 4200] [--slow 520] [--duration-s 30]

Linux (127.0.0.0/8 is all loopback there). It raises its own open-file limit to the
hard limit; the server's must hold the flood too (cluster/ingress.py clamps
--max-connections to it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from machine import cpu_name


@dataclass
class Flood:
    """What the flood's connections met."""

    open_now: Counter[str] = field(default_factory=Counter)  # kind -> connections open now
    events: Counter[str] = field(default_factory=Counter)  # what ended a connection, or refused one
    stop: bool = False

    def record(self, what: str) -> None:
        self.events[what] += 1


def _source(i: int, sources: int) -> str:
    n = 2 + i % sources
    return f"127.0.{n // 256}.{n % 256}"


async def _hold(host: str, port: int, source: str, kind: str, flood: Flood, drip_s: float) -> None:
    """One flood connection, opened again whenever it ends, until the flood stops."""
    while not flood.stop:
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except (TimeoutError, OSError) as e:
            flood.record(f"{kind}: connect failed ({type(e).__name__})")
            await asyncio.sleep(0.5)
            continue
        flood.open_now[kind] += 1
        try:
            if kind == "slow":
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000000\r\n\r\n{")
            while not flood.stop:
                if kind == "slow":
                    writer.write(b" ")
                    await writer.drain()
                try:
                    async with asyncio.timeout(drip_s):
                        data = await reader.read(4096)
                except TimeoutError:
                    continue
                if not data:
                    flood.record(f"{kind}: closed by the server, no answer")
                else:
                    flood.record(f"{kind}: answered {data[9:12].decode(errors='replace')}, closed")
                break
        except (ConnectionResetError, BrokenPipeError):
            flood.record(f"{kind}: reset by the server")
        finally:
            flood.open_now[kind] -= 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await asyncio.sleep(0.05)  # a closed one is opened again at once


async def _probe(host: str, port: int, timeout_s: float) -> tuple[float, int | None]:
    """Seconds for GET /health on a new connection, and its status (None: no answer in time)."""
    started = time.monotonic()
    try:
        async def get() -> int:
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                data = await reader.read()
            finally:
                writer.close()
            return int(data[9:12])

        async with asyncio.timeout(timeout_s):
            status: int | None = await get()
    except (TimeoutError, OSError, ValueError):
        status = None
    elapsed = time.monotonic() - started
    return (elapsed if status is not None else max(elapsed, timeout_s)), status


async def run(args: argparse.Namespace) -> int:
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    flood = Flood()
    baseline = [await _probe(host, port, args.probe_timeout_s) for _ in range(5)]
    holders = [asyncio.create_task(_hold(host, port, _source(i, args.sources), "idle", flood, args.drip_s))
               for i in range(args.idle)]
    holders += [asyncio.create_task(_hold(host, port, _source(i, args.sources), "slow", flood, args.drip_s))
                for i in range(args.slow)]
    deadline = time.monotonic() + args.ramp_s
    while sum(flood.open_now.values()) < args.idle + args.slow and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    up = dict(flood.open_now)
    print(f"flood up: {up.get('idle', 0)} idle + {up.get('slow', 0)} slow-body connections open "
          f"(wanted {args.idle} + {args.slow}) from {args.sources} source addresses", flush=True)
    probes: list[tuple[float, int | None]] = []
    lowest_open = sum(flood.open_now.values())
    end = time.monotonic() + args.duration_s
    while time.monotonic() < end:
        started = time.monotonic()
        probes.append(await _probe(host, port, args.probe_timeout_s))
        lowest_open = min(lowest_open, sum(flood.open_now.values()))
        await asyncio.sleep(max(0.0, args.interval_s - (time.monotonic() - started)))
    flood.stop = True
    for t in holders:
        t.cancel()
    await asyncio.gather(*holders, return_exceptions=True)

    def row(name: str, results: list[tuple[float, int | None]]) -> None:
        lat = sorted(s for s, _ in results)
        ok = sum(1 for _, st in results if st == 200)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        print(f"{name:<16} {len(results):>7} {ok:>5} {statistics.median(lat) * 1000:>11.1f} {p99 * 1000:>9.1f} "
              f"{lat[-1] * 1000:>9.1f}")

    print(f"\n{'/health':<16} {'probes':>7} {'200':>5} {'median ms':>11} {'p99 ms':>9} {'max ms':>9}")
    row("before the flood", baseline)
    row("under the flood", probes)
    print(f"\nflood connections open: {up.get('idle', 0) + up.get('slow', 0)} once up, {lowest_open} at the lowest "
          "while probing")
    print("what ended or refused flood connections: " + ("; ".join(
        f"{what} {n}" for what, n in flood.events.most_common()) or "nothing"))
    median = statistics.median(s for s, _ in probes)
    bar = "PASS" if median < 1.0 and all(st == 200 for _, st in probes) else "FAIL"
    print(f"\nbar (issue 46): /health median under 1 s, every probe 200: {bar}")
    return 0 if bar == "PASS" else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (its HAProxy ingress)")
    p.add_argument("--idle", type=int, default=4200, help="idle connections (default 4200)")
    p.add_argument("--slow", type=int, default=520, help="slow-body connections (default 520)")
    p.add_argument("--sources", type=int, default=40, help="loopback source addresses the flood comes from")
    p.add_argument("--drip-s", type=float, default=1.0, help="seconds between a slow body's bytes")
    p.add_argument("--ramp-s", type=float, default=30.0, help="most seconds to wait for the flood to be up")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of probing under the flood")
    p.add_argument("--interval-s", type=float, default=0.2, help="seconds between /health probes")
    p.add_argument("--probe-timeout-s", type=float, default=10.0)
    args = p.parse_args()
    if not 1 <= args.sources <= 60000:
        p.error("--sources: 1 to 60000")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.idle + args.slow + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(wanted, soft)), hard))
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < wanted:
        p.error(f"the open-file limit ({hard}) cannot hold {wanted} sockets; raise it (ulimit -Hn) or flood less")
    print(f"# bench/ingress_flood.py {' '.join(sys.argv[1:])}; {cpu_name()}", flush=True)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
