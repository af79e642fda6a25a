"""The test seam: the one way an injected fault reaches production code.

Nothing in pdserve injects a fault of its own. Tests, and the chaos harness
(tests/chaos/), reach the failure paths through this module alone: production
code imports it, never an implementation. Off, as every server runs, it costs
nothing: a transport holds None and checks `is not None` once per message (no
call, no lock), and a worker refuses `inject_fault`.

- KV transfer (workers/transfer/): every sender and receiver takes
  `faults: TransferFaults | None`, None unless a test passes one. A sender asks
  it, for each message it is about to put on the wire, what becomes of that
  message (`on_send`: None, or DROP, CORRUPT or DELAY it); a receiver asks
  whether it is stalled (`receiver_stalled`: it takes data but neither writes
  nor acks it, as a slow decode worker would). The rule-based implementation
  the tests use, `Faults`, lives with them (tests/faults.py).
- A worker process (cluster/actors.py): its actor method `inject_fault(kind)`
  makes the engine thread fail as a bug would (`WorkerFault.ENGINE_CRASH`), or
  one request's row of every step fail as a bad value would (`POISON_ROW`).
  `worker_fault` refuses it unless the process was started with
  PDSERVE_FAULT_INJECTION=1, which the chaos harness sets for the servers it
  starts and no deployment does.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pdserve.workers.messages import KVTransferHeader

FAULT_INJECTION_ENV = "PDSERVE_FAULT_INJECTION"


# -- KV transfer ------------------------------------------------------------------------------


class FaultAction(enum.Enum):
    DROP = "drop"  # the message never leaves (its sequence number is used up, as on a lost link)
    CORRUPT = "corrupt"  # one byte of its K data is flipped after the checksum was taken
    DELAY = "delay"  # it leaves `delay_s` later (in-process: a timer delivers it; on a socket the sender sleeps)


@dataclass(frozen=True)
class MessageFault:
    """What becomes of one message on its way out."""

    action: FaultAction
    delay_s: float = 0.0  # DELAY's


class TransferFaults(Protocol):
    """What a KV transport asks, when a test gave it one. Called on the sender's calling
    thread and on the receiver's I/O (or pair) threads at once: thread-safe, and cheap."""

    def on_send(self, header: KVTransferHeader) -> MessageFault | None:
        """What becomes of the message of `header`, about to leave (a data message, or
        `finish`'s end marker when `header.is_last`): None, it leaves as it is."""

    @property
    def receiver_stalled(self) -> bool:
        """Whether a receiver holds the data it reads (no write, no ack, no verdict) for now."""


def corrupted(frame: np.ndarray) -> np.ndarray:
    """CORRUPT on a host frame: a copy of a uint8 frame with one byte flipped (the original,
    a view of real data, is untouched)."""
    bad: np.ndarray = frame.copy()
    bad[len(bad) // 2] ^= 0xFF
    return bad


# -- worker processes ----------------------------------------------------------------------


class WorkerFault(enum.Enum):
    ENGINE_CRASH = "engine_crash"  # the engine thread raises: the worker exits (code 70) and Ray restarts it
    # One running request's row raises in every step: the engine fails it alone (workers/row_faults.py).
    POISON_ROW = "poison_row"


def worker_fault(kind: str) -> WorkerFault:
    """`kind` as a `WorkerFault`, if this process takes injected faults. PermissionError
    unless it was started with PDSERVE_FAULT_INJECTION=1 (read at each call); ValueError
    for a kind there is none of."""
    if os.environ.get(FAULT_INJECTION_ENV) != "1":
        raise PermissionError(f"fault injection is off ({FAULT_INJECTION_ENV}=1 turns it on)")
    try:
        return WorkerFault(kind)
    except ValueError:
        known = ", ".join(f.value for f in WorkerFault)
        raise ValueError(f"kind: unknown fault {kind!r} (known: {known})") from None


def crash_engine() -> None:
    """ENGINE_CRASH, run on the engine thread: it fails as a bug would."""
    raise RuntimeError("injected engine-thread crash")


def poison_row(engine: Any) -> None:
    """POISON_ROW, run on the engine thread (`engine`: its LLMEngine): from the next step that
    samples any request, one of that step's requests (the one with the most tokens still to
    come) is the victim, and building the sampling inputs of any step with it raises, as a
    value past int64 did. Chosen in a step, not now: a worker whose requests are all waiting
    (for their KV, or to be prefilled here) has none running to choose from. Injected again,
    another request is the next victim (one not poisoned already)."""
    runner = engine.runner
    real = runner._sampling_batch
    victim: list[str] = []
    poisoned: set[str] = runner.__dict__.setdefault("_poisoned_rows", set())

    def sampling_batch(reqs: list[Any], token_bitmask: Any = None) -> Any:
        healthy = [r for r in reqs if r.request_id not in poisoned]
        if not victim and healthy:
            victim.append(max(healthy, key=lambda r: r.max_tokens - r.num_output_tokens).request_id)
            poisoned.add(victim[0])
        if victim and any(r.request_id == victim[0] for r in reqs):
            raise OverflowError(f"injected: the row of request {victim[0]} cannot be built")
        return real(reqs, token_bitmask)

    runner._sampling_batch = sampling_batch
