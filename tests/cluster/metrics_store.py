"""What the replica-metrics tests share: Ray's key-value store as a dict, and a family's
samples by replica label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Store:
    """Ray's key-value store as a dict (what every replica of a deployment shares)."""

    def __init__(self) -> None:
        self.values: dict[int, bytes] = {}

    def put(self, rank: int, payload: bytes) -> None:
        self.values[rank] = payload

    def get(self, rank: int) -> bytes | None:
        return self.values.get(rank)


def by_replica(text: bytes, name: str) -> dict[str, float]:
    """Family `name`'s samples in `text`, by their `replica` label ("" where none)."""
    return {s.labels.get("replica", ""): s.value for f in text_string_to_metric_families(text.decode())
            for s in f.samples if s.name == name}
