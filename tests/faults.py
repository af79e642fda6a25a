"""`Faults`: the rule-based fault injector the tests hand to a KV transport, through the
test seam (workers/fault_seam.py: `TransferFaults`); nothing in pdserve imports it.

A sender asks `on_send(header)` for each message it is about to put on the wire, and
applies the first matching rule (each rule fires once):
  * DROP: the message never leaves (its sequence number is used up, as on a lost link);
  * CORRUPT: one byte of the K frame is flipped after the checksum was taken;
  * DELAY: the message leaves `delay_s` later (in-process: delivered by a timer;
    ZeroMQ: the sender sleeps first).
A receiver given the same object stops draining its socket while
`stall_receiver()` is in effect: a slow decode worker, for flow-control tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdserve.workers.fault_seam import FaultAction, MessageFault
from pdserve.workers.messages import KVTransferHeader


@dataclass(frozen=True)
class FaultRule:
    fault: MessageFault
    request_id: str | None = None  # None matches any request
    layer: int | None = None  # None matches any layer; ignored for the end marker
    end_marker: bool = False  # match finish()'s end marker instead of a data message

    def matches(self, header: KVTransferHeader) -> bool:
        if self.end_marker != header.is_last:
            return False
        if self.request_id is not None and self.request_id != header.request_id:
            return False
        return header.is_last or self.layer is None or self.layer == header.layer


class Faults:
    """Rules for a sender, and a stall switch for a receiver (a `TransferFaults`). Thread-safe."""

    def __init__(self) -> None:
        self._rules: list[FaultRule] = []
        self._lock = threading.Lock()
        self._stalled = threading.Event()

    def drop(self, *, request_id: str | None = None, layer: int | None = None, end_marker: bool = False) -> None:
        self._add(FaultRule(MessageFault(FaultAction.DROP), request_id, layer, end_marker))

    def corrupt(self, *, request_id: str | None = None, layer: int | None = None) -> None:
        self._add(FaultRule(MessageFault(FaultAction.CORRUPT), request_id, layer))

    def delay(self, seconds: float, *, request_id: str | None = None, layer: int | None = None,
              end_marker: bool = False) -> None:
        self._add(FaultRule(MessageFault(FaultAction.DELAY, seconds), request_id, layer, end_marker))

    def on_send(self, header: KVTransferHeader) -> MessageFault | None:
        """The fault of the first rule matching `header`, the rule removed so it fires once; None if none matches."""
        with self._lock:
            for i, rule in enumerate(self._rules):
                if rule.matches(header):
                    return self._rules.pop(i).fault
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
