"""KV cache events a worker publishes so a router can track what it caches."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVEventKind(str, enum.Enum):
    STORED = "stored"  # a full block's content became reusable under `block_hash`
    REMOVED = "removed"  # that block was evicted; its hash no longer hits here


@dataclass(frozen=True)
class KVEvent:
    kind: KVEventKind
    block_hash: int
    parent_hash: int | None = None
