"""A backend with one healthy fake worker and nothing else: what the benchmarks that call the
gateway's ASGI app directly (no HTTP server, no Ray) put under it. A subclass says how a
request's tokens come (`generate`). A test double: never in the product's serving path."""

from __future__ import annotations

from typing import Any

from pdserve.cluster.backend_api import Health, PoolState, Reliability


class QuietBackend:
    healthy = True
    num_in_flight = 0

    def health(self) -> Health:
        return Health({"fake": PoolState(1, 1)}, serving=True)

    def worker_handles(self) -> dict[str, tuple[str, Any]]:
        return {}

    def router_stats(self) -> None:
        return None

    def reliability(self) -> Reliability:
        return Reliability(self.health())

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass
