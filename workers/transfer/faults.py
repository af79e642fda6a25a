"""Fault injection for tests of the failure paths; both backends take an optional `Faults`.

A sender consults `take(header)` for each message it is about to put on the
wire and applies the first matching rule (each rule fires once):
  * DROP: the message never leaves (its sequence number is used up, as on a lost link);
  * CORRUPT: one byte of the K frame is flipped after the checksum was taken;
  * DELAY: the message leaves `delay_s` later (in-process: delivered by a timer;
    ZeroMQ: the sender sleeps first).
A receiver given the same object stops draining its socket while
`stall_receiver()` is in effect: a slow decode worker, for flow-control tests.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

import numpy as np

from pdserve.workers.messages import KVTransferHeader


class FaultAction(enum.Enum):
    DROP = "drop"
    CORRUPT = "corrupt"
    DELAY = "delay"


@dataclass(frozen=True)
class FaultRule:
    action: FaultAction
    request_id: str | None = None  # None matches any request
    layer: int | None = None  # None matches any layer; ignored for the end marker
    end_marker: bool = False  # match finish()'s end marker instead of a data message
    delay_s: float = 0.0

    def matches(self, header: KVTransferHeader) -> bool:
        if self.end_marker != header.is_last:
            return False
        if self.request_id is not None and self.request_id != header.request_id:
            return False
        return header.is_last or self.layer is None or self.layer == header.layer


class Faults:
    """Rules for a sender, and a stall switch for a receiver. Thread-safe."""

    def __init__(self) -> None:
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self._stalled = threading.Event()

    def drop(self, *, request_id: str | None = None, layer: int | None = None, end_marker: bool = False) -> None:
        self._add(FaultRule(FaultAction.DROP, request_id, layer, end_marker))

    def corrupt(self, *, request_id: str | None = None, layer: int | None = None) -> None:
        self._add(FaultRule(FaultAction.CORRUPT, request_id, layer))

    def delay(self, seconds: float, *, request_id: str | None = None, layer: int | None = None,
              end_marker: bool = False) -> None:
        self._add(FaultRule(FaultAction.DELAY, request_id, layer, end_marker, seconds))

    def take(self, header: KVTransferHeader) -> FaultRule | None:
        """The first rule matching `header`, removed so it fires once; None if none matches."""
        with self._lock:
            for i, rule in enumerate(self._rules):
                if rule.matches(header):
                    return self._rules.pop(i)
        return None

    def stall_receiver(self) -> None:
        self._stalled.set()

    def resume_receiver(self) -> None:
        self._stalled.clear()

    @property
    def receiver_stalled(self) -> bool:
        return self._stalled.is_set()

    def _add(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules.append(rule)


def corrupted(frame: np.ndarray) -> np.ndarray:
    """A copy of a uint8 frame with one byte flipped (the original, a view of real data, is untouched)."""
    bad: np.ndarray = frame.copy()
    bad[len(bad) // 2] ^= 0xFF
    return bad
