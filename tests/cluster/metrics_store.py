"""What the metrics tests share: an exposition parsed by family (each family once), one
sample's value, Ray's key-value store as a dict, and a family's samples by replica label."""

from __future__ import annotations

from collections import Counter
from typing import Any

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


def parse(text: str) -> dict[str, Any]:
    """Family name -> family; fails on a family that appears twice."""
    families = list(text_string_to_metric_families(text))
    names = Counter(f.name for f in families)
    assert all(n == 1 for n in names.values()), [k for k, n in names.items() if n > 1]
    types = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# TYPE"))
    assert all(n == 1 for n in types.values()), types
    return {f.name: f for f in families}


def sample(fams: dict[str, Any], name: str, **labels: str) -> float:
    family = name.removesuffix("_total").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
    (s,) = [s for s in fams[family].samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return s.value
