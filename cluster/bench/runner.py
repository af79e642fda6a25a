"""One run at one rate: requests leave at their arrival times, at most
`max_concurrency` in flight, each under its own deadline.

A `Run` is filled in as requests start, so when Ctrl-C cancels the run the
caller still holds every record: finished ones as measured, the rest marked
'interrupted'.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from .client import RequestBody, RequestRecord, send


@dataclass
class Run:
    rate: float  # requests/s the arrivals were drawn for (inf: all at once); trace replay: its own rate
    records: list[RequestRecord] = field(default_factory=list)
    duration: float = 0.0  # first send to the last reply (or to the interrupt), seconds
    interrupted: bool = False


@dataclass(frozen=True)
class Plan:
    """What one run sends: request i is `bodies[i]`, due `offsets[i]` seconds after the start."""

    url: str
    bodies: list[RequestBody]
    input_lens: list[int]
    output_lens: list[int]
    offsets: list[float]
    max_concurrency: int | None
    timeout_s: float
    # An output's tokens from its text, for servers that report no usage (None: chunks counted).
    count_tokens: Callable[[str], int] | None = None

    def __post_init__(self) -> None:
        n = len(self.bodies)
        if not len(self.input_lens) == len(self.output_lens) == len(self.offsets) == n:
            raise ValueError("plan: bodies, lengths and offsets must have the same length")
        if not all(math.isfinite(t) and t >= 0 for t in self.offsets):  # NaN compares false: all sent at once
            raise ValueError("plan: send times must be finite and >= 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency: must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout: must be > 0, got {self.timeout_s}")


async def execute(plan: Plan, run: Run, client: aiohttp.ClientSession, progress: bool = True) -> Run:
    sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
    bar = tqdm(total=len(plan.bodies), desc=f"rate {run.rate:g}/s", unit="req", disable=not progress,
               file=sys.stderr, leave=False)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + plan.offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(i, plan.input_lens[i], plan.output_lens[i], scheduled=plan.offsets[i])
        run.records.append(rec)
        try:
            async with sem if sem is not None else contextlib.nullcontext():
                await send(client, plan.url, plan.bodies[i], plan.timeout_s, rec, t0, plan.count_tokens)
        except asyncio.CancelledError:
            rec.error = rec.error or "interrupted before sending (client queue)"
            raise
        except Exception as e:  # noqa: BLE001 - one request's failure, whatever it is, not the run's end
            rec.error, rec.success = f"client error: {type(e).__name__}: {e}"[:200], False
        bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(plan.bodies))))
    finally:
        run.duration = time.perf_counter() - t0
        run.records.sort(key=lambda r: r.index)
        bar.close()
    return run
