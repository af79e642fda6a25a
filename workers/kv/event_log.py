"""A worker's prefix-cache events as a bounded, numbered log that any number of readers follow.

Every event the block pool emits gets the next sequence number of its log. The log
keeps the last `capacity` of them. A reader (a gateway replica's router) holds an
`EventCursor`: the log it follows and the next sequence number it needs. Reading
does not consume anything, so N replicas polling one worker each see every event:

    read(None)                      -> a snapshot (a new reader)
    read(cursor of this log, seq)   -> events [seq, next_seq) when the log still holds
                                       seq, else a snapshot (a reader that fell behind)
    read(cursor of another log)     -> a snapshot (the worker restarted: a new log)

A snapshot is what the pool caches now, as STORED events, at the log's current
`next_seq`: applied in place of what the reader knew, then followed by the events
from that seq on, it gives the reader the same view as one that read every event.
The pool builds the snapshot (`BlockPool.read_events`, on the engine thread, where
the log is appended to), so it is consistent with its seq.

Each log has an id of its own: a restarted worker's sequence numbers start again
at 0, and a cursor of its previous life must not be taken for one of this life.
"""

from __future__ import annotations

import itertools
import uuid
from collections import deque
from dataclasses import dataclass

from pdserve.workers.kv.events import KVEvent

# Events a worker keeps for readers that fell behind. A reader polls every 0.25 s; a
# GPU worker that prefills ~50k tokens/s in 16-token blocks stores and evicts ~6k
# blocks/s, so this covers ~3 s of that. A reader further behind takes a snapshot:
# ~4 MB pickled for 100k cached blocks, which took ~0.4 s to pickle and as long to
# read back on a loaded 2-core machine. The log must outlast that round trip with a
# margin, or a reader behind would fall behind again by the time its snapshot is
# applied, and live on snapshots. Its memory: ~140 bytes a REMOVED event (tracemalloc;
# a STORED one is the pool's own), ~2.3 MB at most.
DEFAULT_CAPACITY = 16384


@dataclass(frozen=True)
class EventCursor:
    """Where a reader stands in one worker's event log: it has applied every event
    of log `log_id` before `seq` (or a snapshot taken at `seq`)."""

    log_id: str
    seq: int

    def __post_init__(self) -> None:
        if not isinstance(self.log_id, str) or type(self.seq) is not int or self.seq < 0:
            raise ValueError(f"EventCursor: a log id and a seq >= 0, got {self.log_id!r}, {self.seq!r}")


@dataclass(frozen=True)
class EventSlice:
    """What a read returns: `events` are the log's [first_seq, next_seq), or, if
    `snapshot`, every cached block as a STORED event at `next_seq` (then first_seq == next_seq)."""

    log_id: str
    first_seq: int
    next_seq: int
    events: tuple[KVEvent, ...]
    snapshot: bool


class KVEventLog:
    """The last `capacity` events, numbered from 0; not thread-safe (the engine thread owns it)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity: must be > 0, got {capacity}")
        self.log_id = uuid.uuid4().hex
        self.next_seq = 0
        self._events: deque[KVEvent] = deque(maxlen=capacity)

    @property
    def first_seq(self) -> int:
        """The oldest seq still held (== next_seq when empty)."""
        return self.next_seq - len(self._events)

    def append(self, event: KVEvent) -> None:
        self._events.append(event)
        self.next_seq += 1

    def since(self, cursor: EventCursor | None) -> EventSlice | None:
        """The events from `cursor` on, or None when this log cannot give them all
        (no cursor, another log's, one older than the oldest held or past the newest)."""
        if cursor is None or cursor.log_id != self.log_id or not self.first_seq <= cursor.seq <= self.next_seq:
            return None
        events = tuple(itertools.islice(self._events, cursor.seq - self.first_seq, None))
        return EventSlice(self.log_id, cursor.seq, self.next_seq, events, snapshot=False)

    def snapshot(self, cached: tuple[KVEvent, ...]) -> EventSlice:
        """`cached` (the pool's STORED events for what it holds now) as a snapshot at `next_seq`."""
        return EventSlice(self.log_id, self.next_seq, self.next_seq, cached, snapshot=True)
